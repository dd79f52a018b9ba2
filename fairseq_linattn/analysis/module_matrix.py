"""The row-stochastic attention matrix of one of our attention modules, for analysis only.

Given a module of ``fairseq_linattn.modules.attention`` and its (T, B, C) self-attention input, q and k
are projected with the module's own ``q_proj`` / ``k_proj`` and the matrix P with out = P V (V the
module's ``v_proj`` output, before ``out_proj``) is materialised: O(R N) memory for R query rows.
Queries with no visible key (a padded query in a block of padding) get a row of zeros.

What P is, per method:
- ``softmax``: softmax(q k^T / sqrt(D)) with the causal and padding masks. Exact: P V = output.
- ``lln``: the LLN matrix (LLN eq. 8-9) with the module's alpha, beta. Exact.
- ``lln_diag``: mix of P_lln and the block-diagonal softmax P_diag (LLN §4.2). ``average``:
  0.5 P_lln + 0.5 P_diag, exact. The learnable mixes weigh each value channel c separately
  (r_c, p_c): there P uses the head's mean weights, ``learnable_ratio`` r̄ P_lln + (1 - r̄) P_diag,
  ``learnable_scale`` (r̄ P_lln + p̄ P_diag) / (r̄ + p̄); exact when the weights are constant over a
  head's channels (for ``learnable_scale`` the output is then (r̄ + p̄) P V).
- ``kernelized`` / ``skyformer``: their kernel rows C (Gaussian kernel, Skyformer §4.1; its Nyström
  approximation C_Q M^-1 C_K^T, §4.2, with the deterministic eval landmarks) are not row-stochastic:
  P = C / (C 1), each row normalised, so output = (C 1) * (P V). Negative entries of the Nyström
  approximation (from the approximate inverse) are set to 0 before normalising.
- ``lavo`` (self-attention): the token-mixing matrix, exact over tokens. With A the local window
  softmax (with its relative bias) and, for query t, m_t = the mean of the rows A_j over the memory
  tokens j of t (non-padded tokens of earlier windows if causal, all if not; LAVO eq. 3),
  P_t = 0.5 A_t + 0.5 m_t (P_t = A_t without memory). The output is
  0.5 A_t V + 0.5 Pi_t (m_t V) with Pi_t = sum_i p_ti B_i B_i^T a per-query channel mixing (p_t the
  memory softmax of eq. 4, B the bases), so P V is not the output: P says which tokens a query
  reads, Pi_t how their values are projected. LAVO cross-attention is excluded (its token mixing is
  the uniform mean over the source).
"""
import math
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from .concentration import attention_matrix, select_rows
from ..ops.kernelized import kernelized_kernel_matrix
from ..ops.skyformer import skyformer_kernel_matrix

ROW_NORMALISED_METHODS = ("kernelized", "skyformer")

Rows = Union[None, int, Tensor]


def _check_module(module) -> str:
    from ..modules.attention import ATTENTION_CLASSES, AttentionBase

    if not isinstance(module, AttentionBase):
        raise ValueError(f"module must be a fairseq_linattn attention module ({', '.join(ATTENTION_CLASSES)}), "
                         f"got {type(module).__name__}")
    if getattr(module, "cross", False):
        raise ValueError("LAVO cross-attention has no token-level attention matrix (every query reads the "
                         "mean of the source); analyse self-attention modules")
    return module.method


def projected_qk(module, query: Tensor) -> Tuple[Tensor, Tensor]:
    """The module's q, k (B, H, N, D) for a (T, B, C) self-attention input."""
    _check_module(module)
    if not isinstance(query, Tensor) or query.dim() != 3 or query.shape[-1] != module.embed_dim:
        raise ValueError(f"query must be a (T, B, C = {module.embed_dim}) tensor, got "
                         f"{tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    return module._heads(module.q_proj(query)), module._heads(module.k_proj(query))


@torch.no_grad()
def lln_parameters(module, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """alpha, beta (shape (G,), G = H per head or 1 per layer) that the LLN module's next forward on
    q, k would use, with sigma_q, sigma_k and tau (eq. 11); float64.

    The matcher runs in eval mode, so its EMA buffers are not updated (an EMA forward in training
    also uses the buffers from before its batch, so the values are the same); the matcher's
    ``last_*`` logging values are restored afterwards. Batch statistics are not all-reduced.
    """
    matcher = module.matcher
    names = ("last_sigma_q", "last_sigma_k", "last_alpha", "last_beta", "last_tau")
    saved, was_training = {n: getattr(matcher, n) for n in names}, matcher.training
    matcher.train(False)
    try:
        matcher(q, k, key_padding_mask)
        return {n[len("last_"):]: getattr(matcher, n) for n in names}
    finally:
        matcher.train(was_training)
        for n, value in saved.items():
            setattr(matcher, n, value)


def _heads4(x: Tensor) -> Tensor:
    """(G,) per-head or per-layer values -> (1, G, 1, 1)."""
    return torch.as_tensor(x).reshape(1, -1, 1, 1)


def _masked_softmax_rows(logits: Tensor, masked: Tensor) -> Tensor:
    """Softmax over the last dim without the masked entries; rows with nothing left give 0."""
    p = logits.masked_fill(masked, float("-inf")).softmax(-1)
    return p.nan_to_num(0.0)


def _key_mask(index: Tensor, s: int, key_padding_mask: Optional[Tensor], device) -> Tensor:
    """(B or 1, 1, R, S) mask of padded keys (rows ``index`` of the matrix)."""
    if key_padding_mask is None:
        return torch.zeros(1, 1, len(index), s, dtype=torch.bool, device=device)
    return key_padding_mask.bool()[:, None, None, :].expand(-1, 1, len(index), s)


def _block_softmax_rows(q: Tensor, k: Tensor, index: Tensor, block_size: int, causal: bool,
                        key_padding_mask: Optional[Tensor]) -> Tensor:
    """Rows ``index`` of the block-diagonal softmax matrix (LLN §4.2): keys in the query's block."""
    n, d = k.shape[2], q.shape[-1]
    j = torch.arange(n, device=q.device)
    masked = (j[None, :] // block_size != index[:, None] // block_size)[None, None]
    if causal:
        masked = masked | (j[None, :] > index[:, None])
    masked = masked | _key_mask(index, n, key_padding_mask, q.device)
    return _masked_softmax_rows(q[:, :, index] @ k.transpose(-1, -2) / math.sqrt(d), masked)


def kernel_rows(module, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], rows: Rows = None) -> Tensor:
    """Rows of a kernel method's unnormalised C (B, H, R, N): out = C V (Skyformer §4.1-4.2).

    Skyformer's Nyström C_Q M^-1 C_K^T uses the deterministic eval landmarks (``training=False``).
    """
    index = select_rows(rows, q.shape[2], q.device)
    if module.method == "kernelized":
        return kernelized_kernel_matrix(q[:, :, index], k, key_padding_mask=key_padding_mask)
    c = skyformer_kernel_matrix(q, k, num_landmarks=module.num_landmarks, key_padding_mask=key_padding_mask,
                                mode=module.landmark_mode, exact_inverse=module.exact_inverse, training=False)
    return c[:, :, index]


def lavo_token_mixing(module, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None,
                      rows: Rows = None) -> Tuple[Tensor, Tensor, Tensor]:
    """LAVO's local matrix A and memory mean m (rows ``rows``), and whether each row has memory.

    q, k (B, H, N, D) -> A (B, H, R, N), m (B, H, R, N) (row t: mean of A_j over t's memory tokens j),
    has_memory (B, R) bool. See the module docstring for how they give the output.
    """
    b, h, n, d = q.shape
    w = module.window
    ct = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k = q.to(ct), k.to(ct)
    pos_bias = module.pos_bias.to(ct)
    valid = ~key_padding_mask.bool() if key_padding_mask is not None else torch.ones(b, n, dtype=torch.bool,
                                                                                        device=q.device)
    j = torch.arange(n, device=q.device)

    def local_rows(idx: Tensor) -> Tensor:
        t = idx[:, None]
        # causal: keys t-w+1..t; non-causal: the query's window; score q·k/sqrt(D) + P[j - t + w - 1]
        window = (j <= t) & (j > t - w) if module.causal else (j // w) == (t // w)
        bias = pos_bias[:, (j - t + w - 1).clamp(0, 2 * w - 2)]  # (H, R, N)
        logits = q[:, :, idx] @ k.transpose(-1, -2) / math.sqrt(d) + bias
        return _masked_softmax_rows(logits, ~(window[None, None] & valid[:, None, None, :]))

    nw = -(-n // w)
    window_sums = torch.zeros(b, h, nw, n, dtype=ct, device=q.device)  # sum over each window's valid rows of A
    for m in range(nw):
        idx = j[m * w:(m + 1) * w]
        window_sums[:, :, m] = (local_rows(idx) * valid[:, None, idx, None]).sum(2)
    window_counts = torch.nn.functional.pad(valid.to(ct), (0, nw * w - n)).view(b, nw, w).sum(2)  # (B, nw)
    index = select_rows(rows, n, q.device)
    if module.causal:  # windows < m (LAVO eq. 3)
        mem_sum = window_sums.cumsum(2) - window_sums
        mem_cnt = window_counts.cumsum(1) - window_counts
        mem_sum, mem_cnt = mem_sum[:, :, index // w], mem_cnt[:, index // w]
    else:
        mem_sum = window_sums.sum(2, keepdim=True).expand(-1, -1, len(index), -1)
        mem_cnt = window_counts.sum(1, keepdim=True).expand(-1, len(index))
    memory = mem_sum / mem_cnt.clamp_min(1)[:, None, :, None]
    return local_rows(index), memory, mem_cnt > 0


@torch.no_grad()
def attention_rows(module, q: Tensor, k: Tensor, *, key_padding_mask: Optional[Tensor] = None, rows: Rows = None,
                   lln: Optional[Dict[str, Tensor]] = None) -> Tensor:
    """Rows of the module's row-stochastic attention matrix from its projected q, k (B, H, N, D).

    ``rows``: None (all), an int (that many evenly spaced rows) or a LongTensor of indices.
    ``lln``: alpha, beta (shape (G,)) to use for LLN modules, e.g. the matcher's ``last_alpha`` /
    ``last_beta`` of the forward being analysed; by default ``lln_parameters(module, q, k, mask)``.
    Returns P (B, H, R, N); float32 for half inputs. The module docstring says what P is per method.
    """
    method = _check_module(module)
    causal, n = module.causal, q.shape[2]
    index = select_rows(rows, n, q.device)
    if method == "softmax":
        return attention_matrix("softmax", q, k, causal=causal, key_padding_mask=key_padding_mask,
                                rows=index).nan_to_num(0.0)
    if method in ("lln", "lln_diag"):
        lln = lln_parameters(module, q, k, key_padding_mask) if lln is None else lln
        p = attention_matrix("lln", q, k, alpha=_heads4(lln["alpha"]), beta=_heads4(lln["beta"]), causal=causal,
                             key_padding_mask=key_padding_mask, rows=index).nan_to_num(0.0)
        if method == "lln":
            return p
        diag = _block_softmax_rows(q.to(p.dtype), k.to(p.dtype), index, module.block_size, causal, key_padding_mask)
        if module.mix == "average":
            return 0.5 * p + 0.5 * diag  # LLN §4.2
        r = module.mix_r.detach().to(p.dtype).mean(-1)[None, :, None, None]
        if module.mix == "learnable_ratio":
            return r * p + (1 - r) * diag
        s = module.mix_p.detach().to(p.dtype).mean(-1)[None, :, None, None]
        if not bool(((r >= 0) & (s >= 0) & (r + s > 0)).all()):
            raise ValueError("lln_diag mix 'learnable_scale' with negative mean weights r, p has no "
                             "row-stochastic attention matrix")
        return (r * p + s * diag) / (r + s)
    if method in ROW_NORMALISED_METHODS:
        c = kernel_rows(module, q, k, key_padding_mask, index).clamp_min(0.0)
        return c / c.sum(-1, keepdim=True).clamp_min(torch.finfo(c.dtype).tiny)
    local, memory, has_memory = lavo_token_mixing(module, q, k, key_padding_mask, index)
    return torch.where(has_memory[:, None, :, None], 0.5 * (local + memory), local)


def module_attention_matrix(module, query: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                            rows: Rows = None) -> Tensor:
    """P (B, H, R, N) of ``module`` on its (T, B, C) self-attention input; see the module docstring.

    No state of the module changes (LLN's moment matcher runs in eval mode).
    """
    with torch.no_grad():
        q, k = projected_qk(module, query)
    return attention_rows(module, q, k, key_padding_mask=key_padding_mask, rows=rows)

"""Linear Log-Normal attention (LLN, Nahshan et al., eq. 8-9): phi_q = exp(alpha q), phi_k = exp(beta k).

out_i = phi_q(q_i)^T sum_j phi_k(k_j) v_j^T / phi_q(q_i)^T sum_l phi_k(k_l)   (sums over j <= i if causal)

Stabilisation (every shift cancels exactly between numerator and denominator):
- keys are shifted per feature d by a max over keys the query may see (M_d), so that
  z_d = sum_j exp(beta k_jd - M_d) >= 1; the query absorbs exp(M_d) and is shifted by its own max;
- in causal mode M comes from *earlier chunks only*; a key of the current chunk that exceeds it
  carries its own scalar shift g_j >= 0, and each query row is referenced to the running max of g
  over the keys it sees. No output depends on a future token, even through rounding.
"""
from typing import Optional

import torch
from torch import Tensor

from ._checks import (check_key_padding_mask, check_positive_int, check_positive_scale, check_qkv,
                      compute_dtype)

_TINY = 1e-30


def _prepare(q, k, v, alpha, beta, key_padding_mask, same_length):
    """Validated, scaled inputs in the compute dtype: (alpha q, beta k with -inf on pads, [v, 1])."""
    check_qkv(q, k, v, same_length=same_length)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    ct = compute_dtype(q)
    aq = check_positive_scale("alpha", alpha, q).to(ct) * q.to(ct)
    bk = check_positive_scale("beta", beta, q).to(ct) * k.to(ct)
    if key_padding_mask is not None:
        bk = bk.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    v1 = torch.cat([v.to(ct), torch.ones_like(v[..., :1], dtype=ct)], -1)  # last column gives the denominator
    return aq, bk, v1


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _divide(o: Tensor) -> Tensor:
    """[numerator, denominator] -> numerator / denominator; 0 where no key was visible."""
    return o[..., :-1] / o[..., -1:].clamp_min(_TINY)


def _lln_noncausal(aq: Tensor, bk: Tensor, v1: Tensor) -> Tensor:
    m = _finite_or_zero(bk.amax(2, keepdim=True)).detach()  # (B,H,1,D) per-feature key shift
    s = torch.exp(bk - m).transpose(-1, -2) @ v1  # (B,H,D,Dv+1): [sum_j phi_k v_j^T, sum_j phi_k]
    a = aq + m
    fq = torch.exp(a - a.amax(-1, keepdim=True).detach())
    return _divide(fq @ s)


def _lln_causal(aq: Tensor, bk: Tensor, v1: Tensor, chunk_size: int) -> Tensor:
    b, h, n, d = aq.shape
    c = min(chunk_size, n)
    nc = -(-n // c)
    pad = nc * c - n
    aq = torch.nn.functional.pad(aq, (0, 0, 0, pad)).view(b, h, nc, c, d)
    bk = torch.nn.functional.pad(bk, (0, 0, 0, pad), value=float("-inf")).view(b, h, nc, c, d)
    v1 = torch.nn.functional.pad(v1, (0, 0, 0, pad)).view(b, h, nc, c, -1)

    with torch.no_grad():
        m_incl = torch.cummax(bk.amax(3), dim=2).values  # (B,H,nc,D): max over chunks <= c
        m_prev = torch.cat([torch.full_like(m_incl[:, :, :1], float("-inf")), m_incl[:, :, :-1]], 2)
        decay = torch.where(torch.isfinite(m_prev), torch.exp(m_prev - _finite_or_zero(m_incl)),
                            torch.zeros_like(m_prev))  # rescales the state from M^(c) to M^(c+1)
        m_incl, m_prev = _finite_or_zero(m_incl), _finite_or_zero(m_prev)
        g = (bk - m_prev[:, :, :, None]).amax(-1).clamp_min(0)  # (B,H,nc,C) per-key excess over M^(c)
        rho = torch.cummax(g, dim=-1).values  # per-query reference: max g over keys j <= i

    # inter-chunk state: U_c = sum_{j in c} exp(beta k_j - M^(c+1)) [v_j, 1]^T, scanned over chunks
    u = torch.exp(bk - m_incl[:, :, :, None]).transpose(-1, -2) @ v1  # (B,H,nc,D,Dv+1)
    state = torch.zeros_like(u[:, :, 0])
    states = []
    for i in range(nc):
        states.append(state)
        state = state * decay[:, :, i, :, None] + u[:, :, i]
    s_prev = torch.stack(states, 2)  # state before each chunk, referenced to M^(c)

    a = aq + m_prev[:, :, :, None]
    fq = torch.exp(a - a.amax(-1, keepdim=True).detach())
    fk = torch.exp(bk - m_prev[:, :, :, None] - g[..., None])
    causal = torch.ones(c, c, dtype=torch.bool, device=aq.device).tril()
    rel = (g[..., None, :] - rho[..., :, None]).masked_fill(~causal, float("-inf"))  # g_j - rho_i
    w = (fq @ fk.transpose(-1, -2)) * torch.exp(rel)  # (B,H,nc,C,C) intra-chunk weights
    o = w @ v1 + (fq @ s_prev) * torch.exp(-rho)[..., None]
    return _divide(o).reshape(b, h, nc * c, -1)[:, :, :n]


def lln_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """LLN attention in O(N D Dv) time (non-causal) or chunked O(N C D + (N/C) D Dv) (causal).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv); alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1). Causal needs S == N. Half inputs compute in fp32.
    """
    chunk_size = check_positive_int("chunk_size", chunk_size)
    aq, bk, v1 = _prepare(q, k, v, alpha, beta, key_padding_mask, same_length=causal)
    out = _lln_causal(aq, bk, v1, chunk_size) if causal else _lln_noncausal(aq, bk, v1)
    return out.to(q.dtype)


def lln_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """Materialised A_ij = exp(alpha q_i) . exp(beta k_j) (LLN eq. 8-9), row-normalised; chunk_size ignored."""
    check_positive_int("chunk_size", chunk_size)
    check_qkv(q, k, v, same_length=causal)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    alpha = check_positive_scale("alpha", alpha, q).to(q.dtype)
    beta = check_positive_scale("beta", beta, q).to(q.dtype)
    a = torch.exp(alpha * q) @ torch.exp(beta * k).transpose(-1, -2)
    if causal:
        a = a.tril()
    if key_padding_mask is not None:
        a = a.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return (a @ v) / a.sum(-1, keepdim=True).clamp_min(_TINY)


def lln_decode_init(batch: int, heads: int, head_dim: int, value_dim: int, *, dtype=torch.float32, device=None):
    """Empty incremental state: S (B,H,D,Dv+1) = [sum phi_k v^T, sum phi_k] and its per-feature shift (B,H,1,D)."""
    s = torch.zeros(batch, heads, head_dim, value_dim + 1, dtype=dtype, device=device)
    shift = torch.full((batch, heads, 1, head_dim), float("-inf"), dtype=dtype, device=device)
    return s, shift


def lln_decode_step(q: Tensor, k: Tensor, v: Tensor, alpha, beta, s: Tensor, shift: Tensor,
                    key_padding_mask: Optional[Tensor] = None):
    """One causal step, O(D Dv): q, k (B,H,1,D), v (B,H,1,Dv), state from ``lln_decode_init``.

    Returns (out (B,H,1,Dv), s, shift). The state is kept in fp32 (fp64 for fp64 inputs).
    """
    aq, bk, v1 = _prepare(q, k, v, alpha, beta, key_padding_mask, same_length=True)
    new_shift = torch.maximum(shift, bk)  # running per-feature max, the current key included
    decay = torch.where(torch.isfinite(shift), torch.exp(shift - _finite_or_zero(new_shift)), torch.zeros_like(shift))
    new_shift_f = _finite_or_zero(new_shift)
    s = s * decay.transpose(-1, -2) + torch.exp(bk - new_shift_f).transpose(-1, -2) @ v1
    a = aq + new_shift_f
    fq = torch.exp(a - a.amax(-1, keepdim=True))
    return _divide(fq @ s).to(q.dtype), s, new_shift

"""Materialised LAVO (docs/design.md §6): token mixing rows (B,H,R,N), the N×N self-attention and the
cross-attention with its memory Xtil formed."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..masking import Rows, masked_softmax, select_rows
from ..precision import compute_dtype
from .inputs import check_cross, check_lavo, check_pos_bias


def lavo_token_mixing(q: Tensor, k: Tensor, pos_bias: Tensor, *, window: int = 64, causal: bool = True,
                      key_padding_mask: Optional[Tensor] = None, rows: Rows = None
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """LAVO's token mixing for query rows ``rows`` (``select_rows``): the local matrix A, the memory mean m.

    q, k (B,H,N,D), pos_bias (H,2w-1) -> A (B,H,R,N), m (B,H,R,N), has_memory (B,R) bool, in the compute dtype.
    A_t: the local window softmax with its relative bias (LAVO §3.2-3.3); m_t: the mean of the rows A_j
    over t's memory tokens j, the non-padded tokens of earlier windows if causal, all if not (eq. 3).
    The output is 0.5 A_t V + 0.5 Pi_t (m_t V) with Pi_t = sum_i p_ti B_i B_i^T (p_t the memory softmax
    of eq. 4), A_t V without memory (see ``lavo_attention_reference``). O(R N + N²/w) memory.
    """
    check_qkv(q, k, k)
    w = check_positive_int("window", window)
    check_pos_bias(pos_bias, q.shape[1], w)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    b, h, n, d = q.shape
    ct = compute_dtype(q)
    q, k, pos_bias = q.to(ct), k.to(ct), pos_bias.to(ct)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    j = torch.arange(n, device=q.device)

    def local_rows(idx: Tensor) -> Tensor:
        t = idx[:, None]
        # causal: keys t-w+1..t; non-causal: the query's window; score q·k/sqrt(D) + P[j - t + w - 1]
        local = (j <= t) & (j > t - w) if causal else (j // w) == (t // w)
        scores = q[:, :, idx] @ k.transpose(-1, -2) / math.sqrt(d) + pos_bias[:, (j - t + w - 1).clamp(0, 2 * w - 2)]
        return masked_softmax(scores, local[None, None] & valid[:, None, None, :])

    nw = -(-n // w)
    window_sums = torch.zeros(b, h, nw, n, dtype=ct, device=q.device)  # sum of A's rows over each window's real tokens
    for m in range(nw):
        idx = j[m * w:(m + 1) * w]
        window_sums[:, :, m] = (local_rows(idx) * valid[:, None, idx, None]).sum(2)
    window_counts = F.pad(valid.to(ct), (0, nw * w - n)).view(b, nw, w).sum(2)  # (B,nw)
    index = select_rows(rows, n, q.device)
    if causal:  # windows < m (LAVO eq. 3)
        mem_sum = (window_sums.cumsum(2) - window_sums)[:, :, index // w]
        mem_cnt = (window_counts.cumsum(1) - window_counts)[:, index // w]
    else:
        mem_sum = window_sums.sum(2, keepdim=True).expand(-1, -1, len(index), -1)
        mem_cnt = window_counts.sum(1, keepdim=True).expand(-1, len(index))
    memory = mem_sum / mem_cnt.clamp_min(1)[:, None, :, None]
    return local_rows(index), memory, mem_cnt > 0


def lavo_attention_weights(q: Tensor, k: Tensor, pos_bias: Tensor, *, window: int = 64, causal: bool = True,
                           key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Row-stochastic token mixing P_t = 0.5 A_t + 0.5 m_t (A_t without memory) of ``lavo_token_mixing``.

    (B,H,R,N). P says which tokens a query reads; P V is not the output (the memory read-out also
    projects the values per query, Pi_t).
    """
    local, memory, has_memory = lavo_token_mixing(q, k, pos_bias, window=window, causal=causal,
                                                  key_padding_mask=key_padding_mask, rows=rows)
    return torch.where(has_memory[:, None, :, None], 0.5 * (local + memory), local)


def lavo_attention_reference(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *,
                             window: int = 64, causal: bool = True,
                             key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """docs/design.md §6 materialised from ``lavo_token_mixing``: N×N A and m, memory Xtil (B,H,N,r,D)."""
    w, key_padding_mask = check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    local, memory, has_memory = lavo_token_mixing(q, k, pos_bias, window=w, causal=causal,
                                                  key_padding_mask=key_padding_mask)
    ct = local.dtype
    q, v, bases = q.to(ct), v.to(ct), bases.to(ct)
    x = local @ v  # F_local (LAVO §3.2-3.3); a query with no allowed key gets 0
    mean = torch.einsum("bhtd,hrd->bhtr", memory @ v, bases)  # H_t = mean of B x_j over t's memory tokens (eq. 3)
    xtil = mean[..., None] * bases[None, :, None]  # Xtil = B ⊙ H, (B,H,N,r,D)
    p = torch.softmax(torch.einsum("bhtd,bhtrd->bhtr", q, xtil) / math.sqrt(q.shape[-1]), -1)  # eq. 4
    glob = torch.einsum("bhtr,bhtrd->bhtd", p, xtil)
    return torch.where(has_memory[:, None, :, None], 0.5 * (x + glob), x)


def lavo_cross_attention_reference(q: Tensor, k_src: Tensor, v_src: Tensor, bases: Tensor, *,
                                   key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Materialises Xtil (B,H,r,D) = H_i * B_i with H = mean over non-padded source of B v_j."""
    key_padding_mask = check_cross(q, k_src, v_src, bases, key_padding_mask)
    ct = compute_dtype(q)
    q, v, bases = q.to(ct), v_src.to(ct), bases.to(ct)
    keep = torch.ones(v.shape[0], v.shape[2], dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        keep = ~key_padding_mask
    out = torch.zeros_like(q)
    for bi in range(q.shape[0]):
        if not keep[bi].any():
            continue  # no source token: no memory, output 0
        code = torch.einsum("hsd,hrd->hsr", v[bi][:, keep[bi]], bases).mean(1)  # H (eq. 3), (H,r)
        xtil = code[..., None] * bases  # (H,r,D)
        p = torch.softmax(q[bi] @ xtil.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)  # eq. 4
        out[bi] = p @ xtil
    return out

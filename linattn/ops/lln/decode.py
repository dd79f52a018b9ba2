"""LLN decoding one token at a time: q, k (B,H,1,D), v (B,H,1,Dv) against a state S (B,H,D,Dv+1), O(D Dv)."""
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_scales, check_qkv
from ..precision import autocast_off, compute_dtype
from .features import _divide, _finite_or_zero, _with_ones


def _prepare(q, k, v, alpha, beta, key_padding_mask, same_length):
    """Validated, scaled inputs in the compute dtype: (alpha q, beta k with -inf on pads, v)."""
    check_qkv(q, k, v, same_length=same_length)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    ct = compute_dtype(q)
    alpha, beta = check_positive_scales(q, alpha=alpha, beta=beta)
    aq = alpha.to(ct) * q.to(ct)
    bk = beta.to(ct) * k.to(ct)
    if key_padding_mask is not None:
        bk = bk.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    return aq, bk, v.to(ct)


def lln_decode_init(batch: int, heads: int, head_dim: int, value_dim: int, *, dtype=torch.float32, device=None):
    """Empty incremental state: S (B,H,D,Dv+1) = [sum phi_k v^T, sum phi_k] and its per-feature shift (B,H,1,D)."""
    s = torch.zeros(batch, heads, head_dim, value_dim + 1, dtype=dtype, device=device)
    shift = torch.full((batch, heads, 1, head_dim), float("-inf"), dtype=dtype, device=device)
    return s, shift


@autocast_off
def lln_decode_step(q: Tensor, k: Tensor, v: Tensor, alpha, beta, s: Tensor, shift: Tensor,
                    key_padding_mask: Optional[Tensor] = None):
    """One causal step, O(D Dv): q, k (B,H,1,D), v (B,H,1,Dv), state from ``lln_decode_init``.

    Returns (out (B,H,1,Dv), s, shift). The state is kept in fp32 (fp64 for fp64 inputs).
    """
    aq, bk, v = _prepare(q, k, v, alpha, beta, key_padding_mask, same_length=True)
    v1 = _with_ones(v)
    new_shift = torch.maximum(shift, bk)  # running per-feature max, the current key included
    decay = torch.where(torch.isfinite(shift), torch.exp(shift - _finite_or_zero(new_shift)), torch.zeros_like(shift))
    new_shift_f = _finite_or_zero(new_shift)
    s = s * decay.transpose(-1, -2) + torch.exp(bk - new_shift_f).transpose(-1, -2) @ v1
    a = aq + new_shift_f
    fq = torch.exp(a - a.amax(-1, keepdim=True))
    return _divide(fq @ s).to(q.dtype), s, new_shift

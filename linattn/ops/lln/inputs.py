"""LLN's validated inputs, as every implementation (``looped.py``, ``parallel.py``) receives them."""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_positive_scales, check_qkv
from ..precision import compute_dtype


class LLNInputs(NamedTuple):
    """q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv); alpha, beta (B|1,H|1,1,1) constants in the compute dtype; mask
    (B,S) (True = padding) or None; causal; chunk: rows per chunk of the causal form (<= N)."""
    q: Tensor
    k: Tensor
    v: Tensor
    alpha: Tensor
    beta: Tensor
    mask: Optional[Tensor]
    causal: bool
    chunk: int


def lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal: bool, chunk_size: int, upcast: bool,
               per_head: bool = False) -> LLNInputs:
    """Validated inputs: q, k, v in the compute dtype (``upcast``; else in their own dtype), alpha and beta constants
    (learnt scales are folded into q and k, where autograd carries them; q and k are then in the compute dtype),
    the chunk size clamped to N. ``per_head`` (for the fused kernels): alpha, beta given as tensors come as the
    (B, H, 1, 1) halves of the stack their check reads (``check_positive_scales``)."""
    chunk_size = check_positive_int("chunk_size", chunk_size)
    check_qkv(q, k, v, same_length=causal)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    ct = compute_dtype(q)
    alpha, beta = (t.to(ct) for t in check_positive_scales(q, per_head=per_head, alpha=alpha, beta=beta))
    if alpha.requires_grad or beta.requires_grad:
        q, k, alpha, beta = alpha * q.to(ct), beta * k.to(ct), torch.ones_like(alpha), torch.ones_like(beta)
    if upcast:
        q, k, v = q.to(ct), k.to(ct), v.to(ct)
    return LLNInputs(q, k, v, alpha.detach(), beta.detach(), key_padding_mask, causal, min(chunk_size, q.shape[2]))

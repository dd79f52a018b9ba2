"""LAVO's fused implementation: Triton kernels registered as custom ops (``ops/triton/lavo.py``,
``ops/triton/lavo_backward.py``; docs/design.md §1.3.1), forward and backward.

``inputs`` gives q, k, v and the bases in their own half dtype, the relative bias P (H,2w-1) in fp32 (autograd
carries its gradient back to the parameter), tok (B,nw*w) fp32 and valid (B,nw*w) uint8, the real tokens, and the
real-first order the kernels read the rows through, if any (``autograd.lavo_attention``'s ``real_first``). The
memory's means stay torch ops (``memory.py``) inside the custom ops. ``supports`` says which inputs the kernels take;
others run ``parallel``.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..impls import fits_shared_memory
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from ..precision import compute_dtype
from .inputs import LavoInputs, window_valid

MAX_WINDOW = 64  # the largest window: a program holds its (w, 2w) scores and probabilities in registers
SHARED_MEMORY_KIB = {64: 72, 128: 160}  # the largest kernel block at D <= 64 and <= 128, sm_90


def supports(q: Tensor, v: Tensor, window: int = 64, bases_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether the kernels take queries like q (B,H,N,D), values like v, windows of ``window`` tokens and bases of
    ``bases_dtype``: half inputs of one dtype (the bases too: they meet q and the gradient on tensor cores), D <=
    MAX_HEAD_DIM, window <= MAX_WINDOW, fewer than 2^31 elements each, and the kernels' shared memory on q's
    device."""
    return (q.dtype in HALF_DTYPES and v.dtype == q.dtype and bases_dtype in (None, q.dtype)
            and q.shape[-1] <= MAX_HEAD_DIM and window <= MAX_WINDOW and max(q.numel(), v.numel()) <= MAX_ELEMENTS
            and fits_shared_memory(q.device, SHARED_MEMORY_KIB, q.shape[-1]))


def inputs(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, key_padding_mask: Optional[Tensor],
           window: int, causal: bool, order: Optional[Tensor] = None) -> LavoInputs:
    """q, k, v, bases as given; P (H,2w-1) fp32 under autograd; the real tokens as tok (fp32) and valid (uint8: the
    bool's bytes, a view) by position; with ``order`` (B,N) (``real_tokens.real_first_order``'s, ``key_padding_mask``
    then in that order) the positions are those of each row's real-first order, as int32."""
    valid = window_valid(q, window, key_padding_mask)
    return LavoInputs(q, k, v, bases, pos_bias.to(compute_dtype(q)), valid.to(compute_dtype(q)),
                      valid=valid.contiguous().view(torch.uint8),
                      order=None if order is None else order.to(torch.int32), causal=causal)


def forward(x: LavoInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    """0.5 (F_local + F_global) (B,H,N,D) in q's dtype, and the window sums of F_local, the memory's means and
    F_local's weights (fp32) for ``backward``."""
    from ..triton.lavo import lavo
    out, win, mean, coef = lavo(x.q, x.k, x.v, x.bases, x.bias, x.valid, x.tok, x.order, x.causal)
    return out, (win, mean, coef)


def backward(x: LavoInputs, saved: Tuple[Tensor, Tensor, Tensor], grad: Tensor) -> LavoInputs:
    """dq, dk, dv, dbases in their inputs' dtype and dP (H,2w-1) fp32."""
    from ..triton.common import grads_of
    from ..triton.lavo_backward import lavo_backward

    *grads, dbases, dbias = lavo_backward(x.q, x.k, x.v, x.bases, x.bias, x.valid, x.tok, x.order, grad, *saved,
                                          x.causal)
    dq, dk, dv = grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v
    return LavoInputs(q=dq, k=dk, v=dv, bases=dbases, bias=dbias)

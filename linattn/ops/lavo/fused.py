"""LAVO's fused implementation: Triton kernels registered as custom ops (``ops/triton/lavo.py``,
``ops/triton/lavo_backward.py``; docs/design.md §1.3.1), forward and backward.

``inputs`` gives q, k, v and the bases in their own half dtype, the relative bias P (H,2w-1) in fp32 (autograd
carries its gradient back to the parameter), tok (B,nw*w) fp32 and valid (B,nw*w) uint8, the real tokens, and the
real-first order the kernels read the rows through, if any (``READS_REAL_FIRST``; ``autograd.lavo_attention``'s
``real_first``). The memory's means stay torch ops (``memory.py``) inside the custom ops. ``SUPPORT`` and
``not_supported_reasons`` say which inputs the kernels take.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..impls import Support
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from ..packed_heads import packs_grads
from ..precision import compute_dtype
from .inputs import LavoInputs, window_valid

READS_REAL_FIRST = True  # with ``real_first`` the kernels read the rows through each row's real-first order
MAX_WINDOW = 64  # the largest window: a program holds its (w, 2w) scores and probabilities in registers
SHARED_MEMORY_KIB = {64: 72, 128: 160}  # the largest kernel block at D <= 64 and <= 128, sm_90
SUPPORT = Support(dtypes=HALF_DTYPES, devices=("cuda",), triton=True, causal=True, max_head_dim=MAX_HEAD_DIM,
                  max_elements=MAX_ELEMENTS, shared_memory_kib=SHARED_MEMORY_KIB)


def not_supported_reasons(q: Tensor, v: Tensor, *, causal: bool = False, window: int = 64,
                          bases_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
                          ) -> List[str]:
    """Why the kernels cannot take queries like q (B,H,N,D), values like v, windows of ``window`` tokens and bases
    of ``bases_dtype`` (``SUPPORT``'s reasons, on ``device`` for a stand-in q; the bases in q's dtype: they meet q
    and the gradient on tensor cores; window <= MAX_WINDOW); [] where they can."""
    reasons = SUPPORT.reasons(q, v, causal=causal, device=device)
    if bases_dtype not in (None, q.dtype):
        reasons.append(f"bases' dtype {bases_dtype} is not the queries' {q.dtype}")
    if window > MAX_WINDOW:
        reasons.append(f"window {window} > {MAX_WINDOW} (its scores are held in registers)")
    return reasons


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
                                          x.causal, packs_grads(x.q, x.k, x.v))
    dq, dk, dv = grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v
    return LavoInputs(q=dq, k=dk, v=dv, bases=dbases, bias=dbias)

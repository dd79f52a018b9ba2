"""Block softmax's fused implementation: one Triton program per block (``ops/triton/block_softmax.py``; docs/design.md
§1.3.1), forward and backward.

``BlockInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in their own half dtype and as mask the key padding mask (B,N)
(True = padded) with its real-first order (B,N) int32, or both None: the kernel reads each block's rows through the
order and forms its visible keys (not padded, before the end, not later if causal). ``supports`` says which inputs
the kernels take; others run ``parallel``.
"""
from typing import Optional, Tuple

from torch import Tensor

from ..impls import fits_shared_memory
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from .inputs import BlockInputs

MAX_BLOCK = 128  # the largest block: its (bs, bs) scores are held in registers
SHARED_MEMORY_KIB = {64: 48, 128: 96}  # the largest kernel block at D <= 64 and <= 128, sm_90


def supports(q: Tensor, v: Tensor, block: int = 64) -> bool:
    """Whether the kernels take queries like q (B,H,N,D), values like v (B,H,N,Dv) and blocks of ``block`` rows:
    half inputs of one dtype, D and Dv <= MAX_HEAD_DIM, block <= MAX_BLOCK, fewer than 2^31 elements each, and the
    kernels' shared memory on q's device."""
    return (q.dtype in HALF_DTYPES and v.dtype == q.dtype and q.shape[-1] <= MAX_HEAD_DIM
            and v.shape[-1] <= MAX_HEAD_DIM and block <= MAX_BLOCK and max(q.numel(), v.numel()) <= MAX_ELEMENTS
            and fits_shared_memory(q.device, SHARED_MEMORY_KIB, max(q.shape[-1], v.shape[-1])))


def forward(x: BlockInputs, *, average_with: Optional[Tensor] = None) -> Tuple[Tensor, tuple]:
    """Block softmax (B,H,N,Dv), or 0.5 (average_with + block softmax) with ``average_with`` (B,H,N,Dv) fp32; in q's
    dtype. Nothing to save (the backward recomputes the probabilities)."""
    from ..triton.block_softmax import block_softmax
    return block_softmax(x.q, x.k, x.v, x.mask, x.order, x.block, x.causal, average_with), ()


def backward(x: BlockInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0,
             add_to: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (B,H,N,·) in q's dtype of ``scale`` * block softmax (probabilities recomputed), plus ``add_to``
    (another part's dq, dk, dv, as LLN's in LLN+Diag) if given, added in fp32 in the kernel."""
    from ..triton.block_softmax import block_softmax_backward
    from ..triton.common import grads_of

    grads = block_softmax_backward(x.q, x.k, x.v, grad, x.mask, x.order, x.block, x.causal, float(scale),
                                   *(add_to or (None, None, None)))
    return grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v

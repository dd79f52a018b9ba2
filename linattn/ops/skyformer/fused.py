"""Skyformer's fused implementation: the Nyström apply in Triton kernels registered as custom ops
(``ops/triton/nystrom.py``, ``ops/triton/nystrom_backward.py``; docs/design.md §1.3.1), forward and backward.

``inputs`` gathers the landmarks L (B,H,d,D) from the half rows of Q and K and computes M^-1 (B,H,d,d) under autograd,
in fp32, as the parallel implementation; the kernels form C_Q and C_K in registers from the half q, k and L, and hand
autograd dL/dL and dL/dM^-1 besides dq, dk, dv. ``supports`` says which inputs the kernels take; others run
``parallel``.
"""
from typing import Optional, Tuple

from torch import Tensor

from ..impls import fits_shared_memory
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from ..precision import compute_dtype
from .nystrom import Landmarks, NystromInputs, gather_landmarks, landmark_inverse

MAX_LANDMARKS = 128  # the largest d: a program holds C's (rows, d) block and L in registers
SHARED_MEMORY_KIB = {64: 152, 128: 216}  # the largest block (the backward's ``_rows_grad``), sm_90, Triton 3.6


def supports(q: Tensor, v: Tensor, num_landmarks: int = 128) -> bool:
    """Whether the kernels take queries like q (B,H,N,D), values like v (B,H,N,Dv) and ``num_landmarks`` landmarks:
    half inputs of one dtype, D and Dv <= MAX_HEAD_DIM, at most MAX_LANDMARKS landmarks in use (d, or the 2N rows of
    [Q; K] if fewer), fewer than 2^31 elements each, and the kernels' shared memory on q's device."""
    return (q.dtype in HALF_DTYPES and v.dtype == q.dtype and q.shape[-1] <= MAX_HEAD_DIM
            and v.shape[-1] <= MAX_HEAD_DIM and min(num_landmarks, 2 * q.shape[2]) <= MAX_LANDMARKS
            and max(q.numel(), v.numel()) <= MAX_ELEMENTS
            and fits_shared_memory(q.device, SHARED_MEMORY_KIB, max(q.shape[-1], v.shape[-1])))


def inputs(q: Tensor, k: Tensor, v: Tensor, rows: Landmarks, pad: Optional[Tensor], gamma: float,
           exact_inverse: bool) -> NystromInputs:
    """q, k, v (B,H,N,·) half as given; L (B,H,d,D) and M^-1 (B,H,d,d) in fp32 under autograd (which carries their
    gradient back to q and k); used_cols (B,d) 1 or 0 per slot, fp32."""
    land = gather_landmarks(q, k, rows.idx, pad)
    m_inv = landmark_inverse(land, rows.used, gamma, exact_inverse)
    return NystromInputs(v=v, land=land, m_inv=m_inv, pad=pad, q=q, k=k, used_cols=rows.used.to(compute_dtype(q)))


def forward(x: NystromInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """out (B,H,N,Dv) in q's dtype, and (T, U) (B,H,d,Dv) fp32 for ``backward``."""
    from ..triton.nystrom import nystrom_apply
    out, t, u = nystrom_apply(x.q, x.k, x.v, x.land, x.m_inv, x.used_cols, x.pad)
    return out, (t, u)


def backward(x: NystromInputs, saved: Tuple[Tensor, Tensor], grad: Tensor) -> NystromInputs:
    """dq, dk, dv in the inputs' dtype, dL/dL (B,H,d,D) and dL/dM^-1 (B,H,d,d) fp32."""
    from ..triton.common import grads_of
    from ..triton.nystrom_backward import nystrom_apply_backward

    *grads, dland, dm_inv = nystrom_apply_backward(x.q, x.k, x.v, grad, x.land, x.m_inv, x.used_cols, x.pad, *saved)
    dq, dk, dv = grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v
    return NystromInputs(v=dv, land=dland, m_inv=dm_inv, q=dq, k=dk)

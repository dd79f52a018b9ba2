"""Skyformer's fused implementation: the Nyström apply in Triton kernels registered as custom ops
(``ops/triton/nystrom.py``, ``ops/triton/nystrom_backward.py``; docs/design.md §1.3.1), forward and backward.

``inputs`` gathers the landmarks L (B,H,d,D) from the half rows of Q and K, ``forward`` computes M^-1 (B,H,d,d) by
the iteration in one kernel (``ops/triton/nystrom_inverse.py``), both in fp32 and without autograd; the kernels form
C_Q and C_K in registers from the half q, k and L, and give dL/dL and dL/dM^-1 besides dq, dk, dv. ``backward``
carries dL/dM^-1 to L by the iteration's own derivative (one kernel, from the forward's tape) and adds dL/dL into
the landmarks' rows of dq and dk (as ``looped``): no dense gradient of a gather, and dq, dk, dv stay the packed
gradient the module's projection takes without a copy. ``SUPPORT`` and ``not_supported_reasons`` say which inputs
the kernels take.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..impls import Support
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from ..packed_heads import packs_grads
from ..precision import compute_dtype
from .nystrom import (
                      Landmarks,
                      NystromInputs,
                      add_landmark_grads,
                      gather_landmarks,
                      landmark_inverse,
                      landmark_inverse_grad,
)

MAX_LANDMARKS = 128  # the largest d: a program holds C's (rows, d) block and L in registers
# the largest block: at D <= 64 the backward's ``_rows_grad`` (sm_90, Triton 3.6); at D <= 128 the forward's
# ``_readout`` as built for an A100 (on sm_90 the backward's ``_rows_grad``, 68 KiB)
SHARED_MEMORY_KIB = {64: 90, 128: 96}
SUPPORT = Support(dtypes=HALF_DTYPES, devices=("cuda",), triton=True, causal=False, max_head_dim=MAX_HEAD_DIM,
                  max_elements=MAX_ELEMENTS, shared_memory_kib=SHARED_MEMORY_KIB)


def not_supported_reasons(q: Tensor, v: Tensor, *, causal: bool = False, num_landmarks: int = 128,
                          device: Optional[torch.device] = None) -> List[str]:
    """Why the kernels cannot take queries like q (B,H,N,D), values like v (B,H,N,Dv) and ``num_landmarks``
    landmarks (``SUPPORT``'s reasons, on ``device`` for a stand-in q, and at most MAX_LANDMARKS landmarks in use: d,
    or the 2N rows of [Q; K] if fewer); [] where they can."""
    reasons = SUPPORT.reasons(q, v, causal=causal, device=device)
    if min(num_landmarks, 2 * q.shape[2]) > MAX_LANDMARKS:
        reasons.append(f"{num_landmarks} landmarks > {MAX_LANDMARKS} (held in registers)")
    return reasons


def inputs(q: Tensor, k: Tensor, v: Tensor, rows: Landmarks, pad: Optional[Tensor], gamma: float,
           exact_inverse: bool) -> NystromInputs:
    """q, k, v (B,H,N,·) half as given; L (B,H,d,D) fp32 made without autograd (``backward`` adds its gradient into
    dq, dk); the landmark rows idx, used (B,d), and used_cols (B,d) 1 or 0 per slot, fp32; M^-1 is ``forward``'s."""
    with torch.no_grad():
        land = gather_landmarks(q, k, rows.idx, pad)
    return NystromInputs(v=v, land=land, pad=pad, q=q, k=k, idx=rows.idx, used=rows.used,
                         used_cols=rows.used.to(compute_dtype(q)), gamma=gamma, exact_inverse=exact_inverse)


def forward(x: NystromInputs) -> Tuple[Tensor, tuple]:
    """out (B,H,N,Dv) in q's dtype, and for ``backward``: (T, U) (B,H,d,Dv) fp32, M^-1 (B,H,d,d) and what its
    gradient takes: the iteration's tape (``nystrom_inverse``), or nothing for ``exact_inverse`` (pinv, its small
    graph rebuilt by ``landmark_inverse_grad``)."""
    from ..triton.nystrom import nystrom_apply
    from ..triton.nystrom_inverse import nystrom_inverse
    if x.exact_inverse:
        m_inv, inverse_saved = landmark_inverse(x.land, x.used, x.gamma, True), ()
    else:
        m_inv, tape = nystrom_inverse(x.land, x.used_cols, x.gamma)
        inverse_saved = (tape,)
    out, t, u = nystrom_apply(x.q, x.k, x.v, x.land, m_inv, x.used_cols, x.pad)
    return out, (t, u, m_inv, *inverse_saved)


def backward(x: NystromInputs, saved: tuple, grad: Tensor) -> NystromInputs:
    """dq, dk, dv in the inputs' dtype: the kernel's, plus dL/dL (from the kernel, and through M^-1) added into the
    landmarks' rows of dq and dk in place (views of one tensor for the module's packed q, k, v: no copy after)."""
    from ..triton.common import grads_of
    from ..triton.nystrom_backward import nystrom_apply_backward
    from ..triton.nystrom_inverse import nystrom_inverse_backward

    t, u, m_inv, *inverse_saved = saved
    *grads, dland, dm_inv = nystrom_apply_backward(x.q, x.k, x.v, grad, x.land, m_inv, x.used_cols, x.pad, t, u,
                                                   packs_grads(x.q, x.k, x.v))
    dq, dk, dv = grads_of(*grads, x.q.shape[-1])
    if x.exact_inverse:
        dland += landmark_inverse_grad(x.land, x.used, x.gamma, True, dm_inv)
    else:
        dland += nystrom_inverse_backward(x.land, x.used_cols, x.gamma, inverse_saved[0], dm_inv)
    add_landmark_grads(dq, dk, dland, x.idx, x.pad)
    return NystromInputs(q=dq, k=dk, v=dv)

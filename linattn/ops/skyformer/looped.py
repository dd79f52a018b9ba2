"""Skyformer's looped implementation (fast on CPUs): the Nyström apply out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) in
passes over rows of working size.

C_Q = kappa(Q, L) and C_K = kappa(K, L) are built pass by pass and rebuilt in backward; what is kept are the inputs
and the (B,H,d,Dv) products T = C_K^T V, U = M^-T T. The landmarks' gradient (through C_Q, C_K and through M^-1,
whose small graph is rebuilt) is added into the rows they came from: no dense gradient of a gather.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import working_set
from ..kernelized.kernel import kernel_scale
from .nystrom import (
                      KernelColumns,
                      Landmarks,
                      NystromInputs,
                      add_landmark_grads,
                      gather_landmarks,
                      kernel_rows,
                      landmark_inverse,
                      landmark_inverse_grad,
                      upcast_qk,
)


def inputs(q: Tensor, k: Tensor, v: Tensor, rows: Landmarks, pad: Optional[Tensor], gamma: float,
           exact_inverse: bool) -> NystromInputs:
    """q, k, v (B,H,N,·) in the compute dtype (padded keys 0), the landmarks L (B,H,d,D) and M^-1 (B,H,d,d) made
    without autograd (``backward`` takes their gradient)."""
    q_, k_ = upcast_qk(q, k, pad)
    v_ = v.to(q_.dtype)
    with torch.no_grad():
        land = gather_landmarks(q_, k_, rows.idx, pad)
        m_inv = landmark_inverse(land, rows.used, gamma, exact_inverse)
    return NystromInputs(v=v_, land=land, m_inv=m_inv, pad=pad, q=q_, k=k_, idx=rows.idx, used=rows.used, gamma=gamma,
                         exact_inverse=exact_inverse)


def _columns(x: NystromInputs) -> KernelColumns:
    return KernelColumns(kernel_scale(x.q), x.land, x.used[:, None, None, :].to(x.q.dtype), x.pad)


def _rows_per_pass(x: NystromInputs) -> int:
    b, h, d = x.q.shape[0], x.q.shape[1], x.land.shape[2]
    return max(1, working_set.WORK_ELEMENTS // (b * h * d))


def _values(v: Tensor, pad: Optional[Tensor], r0: int, r1: int) -> Tensor:
    """Rows [r0, r1) of V, padded rows 0."""
    return v[:, :, r0:r1] if pad is None else v[:, :, r0:r1].masked_fill(pad[:, None, r0:r1, None], 0.0)


def forward(x: NystromInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """out (B,H,N,Dv) in the compute dtype, and (T, U) (B,H,d,Dv) for ``backward``."""
    q, k, v, pad = x.q, x.k, x.v, x.pad
    b, h, n, _ = q.shape
    cols = _columns(x)
    step = _rows_per_pass(x)
    t = None
    for r0 in range(0, n, step):
        _, ck = kernel_rows(k, cols, r0, r0 + step, True)
        vc = _values(v, pad, r0, r0 + step)
        part = ck.transpose(-1, -2) @ vc
        t = part if t is None else t.add_(part)
    u = x.m_inv.transpose(-1, -2) @ t
    out = q.new_empty(b, h, n, v.shape[-1])
    for r0 in range(0, n, step):
        torch.matmul(kernel_rows(q, cols, r0, r0 + step)[1], u, out=out[:, :, r0:r0 + step])
    return out, (t, u)


def _kernel_input_grad(dc: Tensor, c: Tensor, xs: Tensor, land: Tensor, dland: Tensor) -> Tensor:
    """dL/dx_s from dL/dC, C = exp(x_s·L - |x_s|²/2 - |L|²/2) (Skyformer §4.1); adds dL/dL into dland.

    dE = dC ⊙ C; dx_s = dE L - rowsum(dE) x_s, dL = dE^T x_s - colsum(dE) L.
    """
    de = dc.mul_(c)
    dland += de.transpose(-1, -2) @ xs - de.sum(-2)[..., None] * land
    return (de @ land).sub_(de.sum(-1, keepdim=True) * xs)


def backward(x: NystromInputs, saved: Tuple[Tensor, Tensor], grad: Tensor) -> NystromInputs:
    """dq, dk, dv (B,H,N,·) in the compute dtype from dL/d(out) (B,H,N,Dv) and ``forward``'s (T, U)."""
    q, k, v, pad, land, idx = x.q, x.k, x.v, x.pad, x.land, x.idx
    t, u = saved
    n, cols, step = q.shape[2], _columns(x), _rows_per_pass(x)
    scale = cols.scale
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dland, du = torch.zeros_like(land), None
    for r0 in range(0, n, step):
        r1 = r0 + step
        qs, cq = kernel_rows(q, cols, r0, r1)
        g = grad[:, :, r0:r1]
        part = cq.transpose(-1, -2) @ g
        du = part if du is None else du.add_(part)
        dqs = _kernel_input_grad(g @ u.transpose(-1, -2), cq, qs, land, dland)
        torch.mul(dqs, scale, out=dq[:, :, r0:r1])
    dt = x.m_inv @ du
    for r0 in range(0, n, step):
        r1 = r0 + step
        ks, ck = kernel_rows(k, cols, r0, r1, True)
        vc = _values(v, pad, r0, r1)
        torch.matmul(ck, dt, out=dv[:, :, r0:r1])
        dks = _kernel_input_grad(vc @ dt.transpose(-1, -2), ck, ks, land, dland)
        torch.mul(dks, scale, out=dk[:, :, r0:r1])
    dland += landmark_inverse_grad(land, x.used, x.gamma, x.exact_inverse, t @ du.transpose(-1, -2))  # T dU^T
    add_landmark_grads(dq, dk, dland, idx, pad)
    if pad is not None:
        for g in (dq, dk, dv):
            g.masked_fill_(pad[:, None, :, None], 0.0)
    return NystromInputs(q=dq, k=dk, v=dv)

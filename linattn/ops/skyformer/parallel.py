"""Skyformer's parallel implementation: the Nyström apply out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) over all 2N rows
of X = [Q; K] at once, in a number of batched ops that does not depend on N (docs/design.md §1.3).

``inputs`` gathers the landmarks L from X and computes M^-1 under autograd ((B,H,d,·) tensors: autograd carries their
gradient back to X); ``forward`` builds [C_Q; C_K] = kappa(X, L) (B,H,2N,d) whole, ``backward`` rebuilds it. X and V
stay in their own dtype (half is saved as half; V apart from any packed projection it is part of) and are upcast
inside; also kept are the (B,H,d,Dv) products T = C_K^T V and U = M^-T T.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..kernelized.kernel import kernel_scale
from ..packed_heads import kept_alone
from ..precision import compute_dtype
from .nystrom import Landmarks, NystromInputs, landmark_inverse


def inputs(q: Tensor, k: Tensor, v: Tensor, rows: Landmarks, pad: Optional[Tensor], gamma: float,
           exact_inverse: bool) -> NystromInputs:
    """X = [Q; K] (B,H,2N,D) and V as given, L (B,H,d,D) gathered from X and M^-1 (B,H,d,d) under autograd."""
    b, h, _, dim = q.shape
    ct = compute_dtype(q)
    x = torch.cat([q, k], dim=2)
    idx = rows.idx
    land = x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], dim)).to(ct) * kernel_scale(q)
    pad2 = None if pad is None else torch.cat([pad, pad], dim=1)
    if pad is not None:
        land = land.masked_fill(pad2.gather(1, idx)[:, None, :, None], 0.0)  # an unused slot may point at one
    m_inv = landmark_inverse(land, rows.used, gamma, exact_inverse)
    # kept for backward: v alone, not the packed projection it may be a part of (X is a new tensor)
    return NystromInputs(v=kept_alone(v), land=land, m_inv=m_inv, pad=pad, qk=x,
                         used_cols=rows.used[:, None, None, :].to(ct), pad2=pad2)


def _scaled_rows(x: Tensor, ct: torch.dtype, pad2: Optional[Tensor]) -> Tensor:
    """X_s = X * D^(-1/4) in the compute dtype, padded rows 0 (whatever they held): (B,H,2N,D)."""
    xs = x.to(ct) * kernel_scale(x)
    return xs if pad2 is None else xs.masked_fill_(pad2[:, None, :, None], 0.0)


def _kernel_columns(xs: Tensor, land: Tensor, used_cols: Tensor) -> Tensor:
    """C = kappa(X_s, L) * used (B,H,2N,d): exp(X_s L^T - |X_s|²/2 - |L|²/2) (Skyformer §4.1), one baddbmm."""
    b, h, rows, dim = xs.shape
    c = torch.baddbmm((land * land).sum(-1).flatten(0, 1)[:, None, :], xs.flatten(0, 1), land.flatten(0, 1).mT,
                      beta=-0.5).view(b, h, rows, -1)
    c = c.sub_((xs * xs).sum(-1, keepdim=True), alpha=0.5)
    return c.clamp_max_(0.0).exp_().mul_(used_cols)  # the exponent is <= 0 but for rounding


def _values(v: Tensor, ct: torch.dtype, pad: Optional[Tensor]) -> Tensor:
    """V in the compute dtype, padded rows 0 (whatever they held)."""
    v = v.to(ct)
    return v if pad is None else v.masked_fill(pad[:, None, :, None], 0.0)


def forward(x: NystromInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """out (B,H,N,Dv) in X's dtype, and (T, U) (B,H,d,Dv) for ``backward``."""
    ct, n = x.land.dtype, x.v.shape[2]
    c = _kernel_columns(_scaled_rows(x.qk, ct, x.pad2), x.land, x.used_cols)
    t = c[:, :, n:].mT @ _values(x.v, ct, x.pad)
    u = x.m_inv.mT @ t
    return (c[:, :, :n] @ u).to(x.qk.dtype), (t, u)


def backward(x: NystromInputs, saved: Tuple[Tensor, Tensor], grad: Tensor) -> NystromInputs:
    """dL/dX (B,H,2N,D) and dL/dV in their inputs' dtype, dL/dL (B,H,d,D) and dL/dM^-1 (B,H,d,d)."""
    qk, v, land, pad, pad2 = x.qk, x.v, x.land, x.pad, x.pad2
    t, u = saved
    ct, n, (b, h, rows, dim) = land.dtype, v.shape[2], qk.shape
    g, vc, xs = grad.to(ct), _values(v, ct, pad), _scaled_rows(qk, ct, pad2)
    c = _kernel_columns(xs, land, x.used_cols)
    du = c[:, :, :n].mT @ g
    dt = x.m_inv @ du
    dv = c[:, :, n:] @ dt
    # dE = dC * C for C = exp(E), E = X_s L^T - |X_s|²/2 - |L|²/2 (Skyformer §4.1):
    # dX_s = dE L - rowsum(dE) X_s, dL = dE^T X_s - colsum(dE) L
    c[:, :, :n].mul_(g @ u.mT)  # C becomes dE in place
    c[:, :, n:].mul_(vc @ dt.mT)
    de = c.flatten(0, 1)
    xs3, land3 = xs.flatten(0, 1), land.flatten(0, 1)
    dland = torch.baddbmm(de.sum(-2)[..., None] * land3, de.mT, xs3, beta=-1).view(land.shape)
    dx = torch.baddbmm(de.sum(-1, keepdim=True) * xs3, de, land3, beta=-1).view(b, h, rows, dim)
    dx = dx.mul_(kernel_scale(qk))
    if pad is not None:
        dx, dv = dx.masked_fill_(pad2[:, None, :, None], 0.0), dv.masked_fill_(pad[:, None, :, None], 0.0)
    return NystromInputs(qk=dx.to(qk.dtype), v=dv.to(v.dtype), land=dland, m_inv=t @ du.mT)  # dL/dM^-1 = T dU^T

"""Skyformer's parallel form: the Nyström terms over all 2N rows of X = [Q; K] at once, in a number of batched ops
that does not depend on N (docs/design.md §1.5)."""
from typing import Optional

import torch
from torch import Tensor

from ..kernelized.kernel import kernel_scale
from ..precision import compute_dtype
from .nystrom import _kernel_inverse


def _scaled_rows(x: Tensor, ct: torch.dtype, pad2: Optional[Tensor]) -> Tensor:
    """X_s = X * D^(-1/4) in the compute dtype, padded rows 0 (whatever they held): (B,H,2N,D)."""
    xs = x.to(ct) * kernel_scale(x)
    return xs if pad2 is None else xs.masked_fill_(pad2[:, None, :, None], 0.0)


def _kernel_columns(xs: Tensor, land: Tensor, used4: Tensor) -> Tensor:
    """C = kappa(X_s, L) * used (B,H,2N,d): exp(X_s L^T - |X_s|²/2 - |L|²/2) (Skyformer §4.1), one baddbmm."""
    b, h, rows, dim = xs.shape
    c = torch.baddbmm((land * land).sum(-1).flatten(0, 1)[:, None, :], xs.flatten(0, 1), land.flatten(0, 1).mT,
                      beta=-0.5).view(b, h, rows, -1)
    c = c.sub_((xs * xs).sum(-1, keepdim=True), alpha=0.5)
    return c.clamp_max_(0.0).exp_().mul_(used4)  # the exponent is <= 0 but for rounding


def _values(v: Tensor, ct: torch.dtype, pad: Optional[Tensor]) -> Tensor:
    """V in the compute dtype, padded rows 0 (whatever they held)."""
    v = v.to(ct)
    return v if pad is None else v.masked_fill(pad[:, None, :, None], 0.0)


class _NystromRows(torch.autograd.Function):
    """out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) with [C_Q; C_K] = kappa(X, L) (B,H,2N,d) built whole and
    rebuilt in backward. x = [Q; K] (B,H,2N,D) and v (B,H,N,Dv) in the input dtype (saved so: half stays half);
    land (B,H,d,D), m_inv (B,H,d,d) in the compute dtype (their gradients go back through the caller's graph);
    used4 (B,1,1,d) compute dtype; pad (B,N), pad2 = [pad, pad] (B,2N) or None. Also saves the (B,H,d,Dv)
    products T = C_K^T V and U = M^-T T."""

    @staticmethod
    def forward(ctx, x, v, land, m_inv, used4, pad, pad2):
        ct, n = land.dtype, v.shape[2]
        c = _kernel_columns(_scaled_rows(x, ct, pad2), land, used4)
        t = c[:, :, n:].mT @ _values(v, ct, pad)
        u = m_inv.mT @ t
        ctx.save_for_backward(x, v, land, m_inv, used4, pad, pad2, t, u)
        return (c[:, :, :n] @ u).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, v, land, m_inv, used4, pad, pad2, t, u = ctx.saved_tensors
        ct, n, (b, h, rows, dim) = land.dtype, v.shape[2], x.shape
        g, vc, xs = grad.to(ct), _values(v, ct, pad), _scaled_rows(x, ct, pad2)
        c = _kernel_columns(xs, land, used4)
        du = c[:, :, :n].mT @ g
        dt = m_inv @ du
        dv = c[:, :, n:] @ dt
        # dE = dC * C for C = exp(E), E = X_s L^T - |X_s|²/2 - |L|²/2 (Skyformer §4.1):
        # dX_s = dE L - rowsum(dE) X_s, dL = dE^T X_s - colsum(dE) L
        c[:, :, :n].mul_(g @ u.mT)  # C becomes dE in place
        c[:, :, n:].mul_(vc @ dt.mT)
        de = c.flatten(0, 1)
        xs3, land3 = xs.flatten(0, 1), land.flatten(0, 1)
        dland = torch.baddbmm(de.sum(-2)[..., None] * land3, de.mT, xs3, beta=-1).view(land.shape)
        dx = torch.baddbmm(de.sum(-1, keepdim=True) * xs3, de, land3, beta=-1).view(b, h, rows, dim)
        dx = dx.mul_(kernel_scale(x))
        if pad is not None:
            dx, dv = dx.masked_fill_(pad2[:, None, :, None], 0.0), dv.masked_fill_(pad[:, None, :, None], 0.0)
        return dx.to(x.dtype), dv.to(v.dtype), dland, t @ du.mT, None, None, None  # dL/dM^-1 = T dU^T


def skyformer_parallel(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, used: Tensor, pad: Optional[Tensor],
                       gamma: float, exact_inverse: bool) -> Tensor:
    """Skyformer's output (B,H,N,Dv) in q's dtype from landmark rows idx (B,d) of X = [Q; K] and their flags
    used (B,d): L gathered and M^-1 computed under autograd ((B,H,d,·) tensors), then ``_NystromRows``."""
    b, h, _, dim = q.shape
    ct = compute_dtype(q)
    x = torch.cat([q, k], dim=2)
    land = x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], dim)).to(ct) * kernel_scale(q)
    pad2 = None if pad is None else torch.cat([pad, pad], dim=1)
    if pad is not None:
        land = land.masked_fill(pad2.gather(1, idx)[:, None, :, None], 0.0)  # an unused slot may point at one
    m_inv = _kernel_inverse(land, used, gamma, exact_inverse)
    return _NystromRows.apply(x, v, land, m_inv, used[:, None, None, :].to(ct), pad, pad2)

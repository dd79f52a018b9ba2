"""Skyformer as an autograd op: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); the looped form here (passes over rows
of working size), the parallel form in ``parallel.py``."""
from typing import Optional

import torch
from torch import Tensor

from .. import working_set
from ..impls import resolve_impl
from ..kernelized.kernel import kernel_scale
from ..precision import autocast_off
from .nystrom import (
                      GAMMA,
                      _check_args,
                      _kernel_input_grad,
                      _kernel_inverse,
                      _kernel_rows,
                      _landmark_rows,
                      _landmark_setup,
                      _landmarks,
)
from .parallel import skyformer_parallel


class _NystromApply(torch.autograd.Function):
    """out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) with C_Q = kappa(Q, L), C_K = kappa(K, L) built
    pass by pass and rebuilt in backward; saves only the inputs, the landmarks L (B,H,d,D), M^-1 and the
    (B,H,d,Dv) products T = C_K^T V, U = M^-T T. q, k, v (B,H,N,·) compute dtype unscaled (padded keys
    0), idx (B,d) landmark rows of [Q; K], used (B,d) bool, pad (B,N) or None. The landmarks' gradient
    (through C_Q, C_K and through M^-1, whose small graph is rebuilt) is added into the rows they came
    from: no dense gradient of a gather."""

    @staticmethod
    def forward(ctx, q, k, v, idx, used, pad, gamma: float, exact_inverse: bool):
        b, h, n, _ = q.shape
        scale = kernel_scale(q)
        land = _landmarks(q, k, idx, pad)
        m_inv = _kernel_inverse(land, used, gamma, exact_inverse)
        used4 = used[:, None, None, :].to(q.dtype)
        step = max(1, working_set.WORK_ELEMENTS // (b * h * land.shape[2]))
        t = None
        for r0 in range(0, n, step):
            _, ck = _kernel_rows(k, scale, pad, land, used4, r0, r0 + step, True)
            vc = v[:, :, r0:r0 + step] if pad is None else v[:, :, r0:r0 + step].masked_fill(
                pad[:, None, r0:r0 + step, None], 0.0)
            part = ck.transpose(-1, -2) @ vc
            t = part if t is None else t.add_(part)
        u = m_inv.transpose(-1, -2) @ t
        out = q.new_empty(b, h, n, v.shape[-1])
        for r0 in range(0, n, step):
            torch.matmul(_kernel_rows(q, scale, pad, land, used4, r0, r0 + step)[1], u, out=out[:, :, r0:r0 + step])
        ctx.save_for_backward(q, k, v, idx, used, pad, land, m_inv, t, u)
        ctx.gamma, ctx.exact, ctx.step = gamma, exact_inverse, step
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, idx, used, pad, land, m_inv, t, u = ctx.saved_tensors
        scale, step, (b, h, n, dim) = kernel_scale(q), ctx.step, q.shape
        used4 = used[:, None, None, :].to(q.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dland, du = torch.zeros_like(land), None
        for r0 in range(0, n, step):
            r1 = r0 + step
            qs, cq = _kernel_rows(q, scale, pad, land, used4, r0, r1)
            g = grad[:, :, r0:r1]
            part = cq.transpose(-1, -2) @ g
            du = part if du is None else du.add_(part)
            dqs = _kernel_input_grad(g @ u.transpose(-1, -2), cq, qs, land, dland)
            torch.mul(dqs, scale, out=dq[:, :, r0:r1])
        dt = m_inv @ du
        for r0 in range(0, n, step):
            r1 = r0 + step
            ks, ck = _kernel_rows(k, scale, pad, land, used4, r0, r1, True)
            vc = v[:, :, r0:r1] if pad is None else v[:, :, r0:r1].masked_fill(pad[:, None, r0:r1, None], 0.0)
            torch.matmul(ck, dt, out=dv[:, :, r0:r1])
            dks = _kernel_input_grad(vc @ dt.transpose(-1, -2), ck, ks, land, dland)
            torch.mul(dks, scale, out=dk[:, :, r0:r1])
        with torch.enable_grad():  # through M^-1 = f(kappa(L, L)): a (d×d) graph, rebuilt
            lg = land.detach().requires_grad_()
            dland += torch.autograd.grad(_kernel_inverse(lg, used, ctx.gamma, ctx.exact), lg,
                                         t @ du.transpose(-1, -2))[0]  # dL/dM^-1 = T dU^T
        dland.mul_(scale)
        if pad is not None:
            dland.masked_fill_(pad.gather(1, idx % n)[:, None, :, None], 0.0)
        from_q = (idx < n)[:, None, :, None]
        rows = lambda i: i[:, None, :, None].expand(b, h, idx.shape[1], dim)
        dq.scatter_add_(2, rows(idx.clamp_max(n - 1)), dland * from_q)
        dk.scatter_add_(2, rows((idx - n).clamp_min(0)), dland * ~from_q)
        if pad is not None:
            for x in (dq, dk, dv):
                x.masked_fill_(pad[:, None, :, None], 0.0)
        return dq, dk, dv, None, None, None, None, None


@autocast_off
def skyformer_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                        key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                        generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                        training: bool = True, causal: bool = False, gamma: float = GAMMA,
                        impl: str = "auto") -> Tensor:
    """out = C_Q ((C_K M^-1)^T V) (Skyformer eq. 6), never forming an N×N matrix.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). ``exact_inverse`` uses pinv(M) instead of the iteration.
    Half inputs compute in float32 (the iteration needs it) and return the input dtype.
    """
    key_padding_mask = _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma)
    if resolve_impl(impl, q.device) == "parallel":
        idx, used = _landmark_rows(q, key_padding_mask, num_landmarks, mode, generator, training)
        return skyformer_parallel(q, k, v, idx, used, key_padding_mask, gamma, exact_inverse)
    q_, k_, idx, used = _landmark_setup(q, k, key_padding_mask, num_landmarks, mode, generator, training)
    # (C_K M^-1)^T V evaluated as M^-T (C_K^T V): O(N·d·Dv + d²·Dv) instead of O(N·d²)
    out = _NystromApply.apply(q_, k_, v.to(q_.dtype), idx, used, key_padding_mask, gamma, exact_inverse)
    return out.to(q.dtype)

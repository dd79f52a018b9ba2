"""Skyformer's M^-1 by its iteration (Skyformer §4.4) as an autograd op with a hand-written backward: a fixed number
of batched (d×d) ops either way, where autograd would launch more and save five matrices per step."""
import torch
from torch import Tensor

NEWTON_STEPS = 6


def _constants(like: Tensor):
    """7I, 15I, 13I/4 (d,d) of the iteration, broadcast over the batch by ``baddbmm``."""
    eye = torch.eye(like.shape[-1], dtype=like.dtype, device=like.device)
    return 7 * eye, 15 * eye, 3.25 * eye


def _horner(p: Tensor, consts):
    """R1 = 7I - P, R2 = 15I - P R1, R3 = 13I/4 - P R2 / 4: with P = A Z, one step is
    Z' = Z (13I - P(15I - P(7I - P))) / 4 = Z R3 (Skyformer §4.4)."""
    i7, i15, i13 = consts
    r1 = torch.sub(i7, p)
    r2 = torch.baddbmm(i15, p, r1, alpha=-1)
    return r1, r2, torch.baddbmm(i13, p, r2, alpha=-0.25)


def _newton_forward(a: Tensor, z: Tensor, steps: int, consts):
    """Z_steps from A, Z_0 (b,d,d), and the tape [Z_0, P_0, Z_1, P_1, ...] its backward needs."""
    tape = []
    for _ in range(steps):
        p = torch.bmm(a, z)
        tape += [z, p]
        z = torch.bmm(z, _horner(p, consts)[2])
    return z, tape


def _newton_backward(a: Tensor, tape, gz: Tensor, consts):
    """(dL/dA, dL/dZ_0) from dL/dZ_steps: the exact derivative of the iteration (not that of A^-1)."""
    da = None
    for z, p in reversed(list(zip(tape[::2], tape[1::2]))):
        r1, r2, r3 = _horner(p, consts)
        ez = torch.bmm(z.mT, gz)  # dR3 = Z^T dZ'
        gz = torch.bmm(gz, r3.mT)  # through Z' = Z R3
        f = torch.bmm(p.mT, ez)  # dR2 = -P^T dR3 / 4 = -F / 4
        w = torch.baddbmm(torch.bmm(ez, r2.mT), f, r1.mT, alpha=-1)
        w = torch.baddbmm(w, p.mT, f)  # dP = -W / 4: -dR3 R2^T / 4 - dR2 R1^T, and -dR1 = P^T dR2
        da = torch.bmm(w, z.mT) if da is None else torch.baddbmm(da, w, z.mT)  # dA = sum_t dP_t Z_t^T
        gz = torch.baddbmm(gz, a.mT, w, alpha=-0.25)  # through P = A Z
    return da.mul_(-0.25), gz


def _initial(a: Tensor):
    """Z_0 = A^T / c with c (b,1,1) the max column sum of A (>= 0 here, so |A| = A)."""
    c = a.sum(-2).amax(-1)[:, None, None]
    return a.mT / c, c


def newton_schulz_inverse(m_hat: Tensor, steps: int = NEWTON_STEPS) -> Tensor:
    """Approximate inverse of (b,d,d) m_hat >= 0 by Z <- Z(13I - AZ(15I - AZ(7I - AZ)))/4 (Skyformer §4.4) from
    Z_0 = A^T / (max column sum of A); plain ops, for analysis (the op's inverse is ``kernel_inverse``)."""
    return _newton_forward(m_hat, _initial(m_hat)[0], steps, _constants(m_hat))[0]


def inverse_forward(land: Tensor, keep: Tensor, gamma: float, steps: int = NEWTON_STEPS):
    """M^-1 ≈ S Z S (B,H,d,d) for M = kappa(L, L) * keep + gamma I, S = diag(M 1)^(-1/2) and Z the iteration's
    inverse of A = S M S (Skyformer §4.4), land (B,H,d,D), keep (B,1,d,d) bool; and what ``inverse_backward`` needs:
    L, S, kappa(L, L), M, A, Z and the iteration's tape, 2·steps + 4 small (B·H,d,d) tensors."""
    shape = (*land.shape[:-1], land.shape[-2])
    l3 = land.flatten(0, 1)
    sq = (l3 * l3).sum(-1)
    # kappa(L, L) = exp(L L^T - |L_i|²/2 - |L_j|²/2), the exponent <= 0 but for rounding
    e = torch.baddbmm(sq[:, :, None] + sq[:, None, :], l3, l3.mT, beta=-0.5).clamp_max_(0.0).exp_()
    m = (e.view(shape) * keep).flatten(0, 1)
    m.diagonal(dim1=-2, dim2=-1).add_(gamma)  # + gamma I
    consts = _constants(m)
    s = m.sum(-1).rsqrt()  # every entry of M >= 0 and its diagonal > 0
    ss = s[:, :, None] * s[:, None, :]
    a = m * ss
    z0, c = _initial(a)
    z, tape = _newton_forward(a, z0, steps, consts)
    return (z * ss).view(shape), (land, keep, e, m, a, c, s, z, *consts, *tape)


def inverse_backward(saved, grad: Tensor) -> Tensor:
    """dL/dL (B,H,d,D) from dL/dM^-1 (B,H,d,d) and ``inverse_forward``'s saved tensors."""
    land, keep, e, m, a, c, s, z, i7, i15, i13, *tape = saved
    g, l3, ss = grad.flatten(0, 1), land.flatten(0, 1), s[:, :, None] * s[:, None, :]
    da, dz0 = _newton_backward(a, tape, g * ss, (i7, i15, i13))  # out = Z ⊙ ss
    # Z_0 = A^T / c, c = max_j sum_i A_ij (ties share the gradient, as autograd's amax)
    w0 = dz0.mT / c
    da = da.add_(w0)
    hit = (a.sum(-2) == c[:, :, 0]).to(a.dtype)
    dc = (w0 * a).sum((-2, -1), keepdim=True).div_(c * hit.sum(-1)[:, None, None])
    da = da.sub_(dc * hit[:, None, :])
    # A = M ⊙ ss, ss = s s^T, s_i = (sum_j M_ij)^(-1/2)
    dss = torch.addcmul(g * z, da, m)
    ds = torch.bmm(dss + dss.mT, s[:, :, None])
    dm = torch.add(da * ss, ds * s[:, :, None] ** 3, alpha=-0.5)
    # M = kappa(L, L) ⊙ keep + gamma I, kappa = exp(E), E = L L^T - |L_i|²/2 - |L_j|²/2 (Skyformer §4.1):
    # with G = dE + dE^T, dL = G L - rowsum(G) L
    de = (dm.view(*land.shape[:2], *dm.shape[1:]) * keep).flatten(0, 1).mul_(e)
    de = de + de.mT
    return torch.baddbmm(de.sum(-1, keepdim=True) * l3, de, l3, beta=-1).view(land.shape)


class _KernelInverse(torch.autograd.Function):
    """``inverse_forward`` under autograd, with ``inverse_backward`` (the iteration's exact derivative)."""

    @staticmethod
    def forward(ctx, land, keep, gamma: float, steps: int):
        out, saved = inverse_forward(land, keep, gamma, steps)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        return inverse_backward(ctx.saved_tensors, grad), None, None, None


def kernel_inverse(land: Tensor, keep: Tensor, gamma: float, steps: int = NEWTON_STEPS) -> Tensor:
    """M^-1 (B,H,d,d) by the iteration for M = kappa(L, L) * keep + gamma I (Skyformer §4.4), land (B,H,d,D)."""
    return _KernelInverse.apply(land, keep, gamma, steps)

"""Skyformer: Nyström approximation of kernelized attention (Skyformer §4.2, eq. 4–6, §4.4; docs/design.md §5).

Non-causal self-attention only. With X = [Q; K] (2N rows, scaled by D^(-1/4)) and d landmark rows L of X:
``C ≈ C_Q M^-1 C_K^T`` with C_Q = kappa(Q, L), C_K = kappa(K, L), M = kappa(L, L) + gamma I, and M^-1
from a Newton–Schulz-type iteration on the degree-normalised M. Cost O(N·d·(D + Dv) + d³).

Landmarks (decisions where the paper is silent):
- per batch element, shared by all heads; only non-padded rows of X are candidates;
- without replacement; when a batch element has fewer valid rows than requested, *all* of its valid
  rows are landmarks and the spare slots are inert (zero columns in C_Q, C_K and an identity block in
  M, decoupled from the rest), so the result is the Nyström form over exactly those rows;
- ``stratified``: ceil(d/2) from the Q rows and floor(d/2) from the K rows; ``uniform``: d over all 2N;
- training: a uniform random subset from ``generator`` (or torch's global RNG), redrawn each call;
  eval (``training=False``): evenly spaced valid rows (deterministic; ``generator`` unused).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._checks import (Rows, autocast_off, check_key_padding_mask, check_positive_int, check_qkv, compute_dtype,
                      select_rows)
from .kernelized import check_non_causal, gaussian_kernel, kernel_scale, kernelized_attention_reference

MODES = ("stratified", "uniform")
GAMMA = 0.1  # ridge added to kappa(L, L) (Skyformer §4.4)
NEWTON_STEPS = 6
_WHAT = "Gaussian-kernel Nyström attention over the whole sequence"


def _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma) -> Optional[Tensor]:
    check_non_causal("skyformer", _WHAT, causal)
    check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    check_positive_int("num_landmarks", num_landmarks)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma < float("inf"):
        raise ValueError(f"gamma must be a finite float >= 0, got {gamma!r}")
    return key_padding_mask


def _pick_rows(valid: Tensor, count: int, generator: Optional[torch.Generator],
               training: bool) -> Tuple[Tensor, Tensor]:
    """Choose min(count, R) of the R rows per batch element among the valid ones, without replacement.

    valid (B,R) bool -> (idx (B,m) long, used (B,m) bool); a slot is unused when the element has fewer
    than m valid rows (its index then points at an arbitrary row).
    """
    b, r = valid.shape
    m = min(count, r)
    if training:
        device = generator.device if generator is not None else valid.device
        scores = torch.rand(b, r, generator=generator, device=device).to(valid.device)
        top, idx = scores.masked_fill(~valid, -1.0).topk(m, dim=1)  # random keys: a uniform m-subset
        return idx, top >= 0
    n = valid.sum(1, keepdim=True)  # (B,1) valid rows per element
    valid_first = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)  # valid row positions, in order
    slot = torch.arange(m, device=valid.device)[None, :]
    rank = torch.where(n >= m, ((2 * slot + 1) * n) // (2 * m), slot)  # evenly spaced ranks, distinct when n >= m
    return valid_first.gather(1, rank.clamp_max(r - 1)), slot < n


def _landmark_indices(valid: Tensor, num_landmarks: int, mode: str, generator, training: bool):
    """Row indices into X = [Q; K] (B,m) and their used-flags (B,m); valid (B,N) marks non-padded tokens."""
    n = valid.shape[1]
    if mode == "uniform":
        return _pick_rows(torch.cat([valid, valid], dim=1), num_landmarks, generator, training)
    from_q = num_landmarks - num_landmarks // 2
    idx_q, used_q = _pick_rows(valid, from_q, generator, training)
    if num_landmarks // 2 == 0:
        return idx_q, used_q
    idx_k, used_k = _pick_rows(valid, num_landmarks // 2, generator, training)
    return torch.cat([idx_q, idx_k + n], dim=1), torch.cat([used_q, used_k], dim=1)


def newton_schulz_inverse(m_hat: Tensor, steps: int = NEWTON_STEPS) -> Tensor:
    """Approximate inverse of (...,d,d) m_hat by Z <- Z(13I - AZ(15I - AZ(7I - AZ)))/4 (Skyformer §4.4).

    Z0 = A^T / (max column sum of |A|), one scalar per matrix.
    """
    eye = torch.eye(m_hat.shape[-1], dtype=m_hat.dtype, device=m_hat.device)
    z = m_hat.transpose(-1, -2) / m_hat.abs().sum(-2).amax(-1)[..., None, None]
    for _ in range(steps):
        az = m_hat @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


_WORK_ELEMENTS = 1 << 20  # values in one (B,H,rows,d) working temporary


def _kernel_rows(x: Tensor, scale: float, pad: Optional[Tensor], land: Tensor, used: Tensor, r0: int, r1: int,
                 zero_padded: bool = False, inplace: bool = True):
    """(x_s, C) for rows [r0, r1): x_s = x * D^(-1/4) (0 on padded rows), C = kappa(x_s, L) * used (B,H,rows,d),
    with zero rows for padded tokens if ``zero_padded`` (the keys). ``inplace=False`` where autograd records."""
    xs = x[:, :, r0:r1] * scale
    if pad is None:
        c = gaussian_kernel(xs, land)
        return xs, c.mul_(used) if inplace else c * used
    rows = pad[:, None, r0:r1, None]
    xs = xs.masked_fill_(rows, 0.0) if inplace else xs.masked_fill(rows, 0.0)
    c = gaussian_kernel(xs, land)
    c = c.mul_(used) if inplace else c * used
    if not zero_padded:
        return xs, c
    return xs, c.masked_fill_(rows, 0.0) if inplace else c.masked_fill(rows, 0.0)


def _kernel_input_grad(dc: Tensor, c: Tensor, xs: Tensor, land: Tensor, dland: Tensor) -> Tensor:
    """dL/dx_s from dL/dC, C = exp(x_s·L - |x_s|²/2 - |L|²/2) (Skyformer §4.1); adds dL/dL into dland.

    dE = dC ⊙ C; dx_s = dE L - rowsum(dE) x_s, dL = dE^T x_s - colsum(dE) L.
    """
    de = dc.mul_(c)
    dland += de.transpose(-1, -2) @ xs - de.sum(-2)[..., None] * land
    return (de @ land).sub_(de.sum(-1, keepdim=True) * xs)


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
        step = max(1, _WORK_ELEMENTS // (b * h * land.shape[2]))
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


def _landmarks(q: Tensor, k: Tensor, idx: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Rows idx (B,m) of X = [Q; K] scaled by D^(-1/4) (eq. 4), gathered without forming X: (B,H,m,D).

    Padded rows count as 0 (an unused slot may point at one).
    """
    b, h, n, dim = q.shape
    m = idx.shape[1]
    pick = lambda x, i: x.gather(2, i[:, None, :, None].expand(b, h, m, dim))
    land = torch.where((idx < n)[:, None, :, None], pick(q, idx.clamp_max(n - 1)), pick(k, (idx - n).clamp_min(0)))
    land = land * kernel_scale(q)
    if key_padding_mask is not None:
        land = land.masked_fill(key_padding_mask.gather(1, idx % n)[:, None, :, None], 0.0)
    return land


def _kernel_inverse(land: Tensor, used: Tensor, gamma: float, exact_inverse: bool) -> Tensor:
    """M^-1 (B,H,d,d) for M = kappa(L, L) + gamma I (Skyformer §4.4); unused slots an inert identity block."""
    eye = torch.eye(used.shape[1], dtype=land.dtype, device=land.device)
    keep = (used[:, :, None] & used[:, None, :])[:, None] | eye.bool()
    m = gaussian_kernel(land, land) * keep + gamma * eye  # M = kappa(L, L) + gamma I
    if exact_inverse:
        return torch.linalg.pinv(m, hermitian=True)
    d_inv_sqrt = m.sum(-1).rsqrt()  # D_M = diag(M 1) > 0: every entry of M is positive
    m_hat = m * d_inv_sqrt[..., :, None] * d_inv_sqrt[..., None, :]
    return newton_schulz_inverse(m_hat) * d_inv_sqrt[..., :, None] * d_inv_sqrt[..., None, :]


def _landmark_setup(q, k, key_padding_mask, num_landmarks, mode, generator, training):
    """(q, k in the compute dtype (padded keys 0), landmark rows idx (B,d) of [Q; K], used (B,d) bool)."""
    b, _, n, _ = q.shape
    ct = compute_dtype(q)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    idx, used = _landmark_indices(valid, num_landmarks, mode, generator, training)
    q_, k_ = q.to(ct), k.to(ct)
    if key_padding_mask is not None:
        k_ = k_.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # whatever padded keys hold (even inf)
    return q_, k_, idx, used


def _nystrom_factors(q, k, key_padding_mask, num_landmarks, mode, generator, exact_inverse, training, gamma):
    """C_Q (B,H,N,d), M^-1 (B,H,d,d), C_K (B,H,N,d) in the compute dtype (padded key rows of C_K zero)."""
    q_, k_, idx, used = _landmark_setup(q, k, key_padding_mask, num_landmarks, mode, generator, training)
    land = _landmarks(q_, k_, idx, key_padding_mask)
    m_inv = _kernel_inverse(land, used, gamma, exact_inverse)
    scale, used4 = kernel_scale(q), used[:, None, None, :]
    _, c_q = _kernel_rows(q_, scale, key_padding_mask, land, used4, 0, q.shape[2], inplace=False)
    _, c_k = _kernel_rows(k_, scale, key_padding_mask, land, used4, 0, q.shape[2], True, inplace=False)
    return c_q, m_inv, c_k


@autocast_off
def skyformer_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                        key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                        generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                        training: bool = True, causal: bool = False, gamma: float = GAMMA) -> Tensor:
    """out = C_Q ((C_K M^-1)^T V) (Skyformer eq. 6), never forming an N×N matrix.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). ``exact_inverse`` uses pinv(M) instead of the iteration.
    Half inputs compute in float32 (the iteration needs it) and return the input dtype.
    """
    key_padding_mask = _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma)
    q_, k_, idx, used = _landmark_setup(q, k, key_padding_mask, num_landmarks, mode, generator, training)
    # (C_K M^-1)^T V evaluated as M^-T (C_K^T V): O(N·d·Dv + d²·Dv) instead of O(N·d²)
    out = _NystromApply.apply(q_, k_, v.to(q_.dtype), idx, used, key_padding_mask, gamma, exact_inverse)
    return out.to(q.dtype)


def skyformer_kernel_matrix(q: Tensor, k: Tensor, *, num_landmarks: int = 128,
                            key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                            generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                            training: bool = True, gamma: float = GAMMA, rows: Rows = None) -> Tensor:
    """Rows of the materialised C_approx = C_Q M^-1 C_K^T (B,H,R,N) in the compute dtype (analysis and tests).

    Same landmarks as ``skyformer_attention`` for the same arguments and generator state (chosen from
    all N tokens whatever ``rows``, which is as ``select_rows``).
    """
    key_padding_mask = _check_args(q, k, k, key_padding_mask, num_landmarks, mode, generator, False, gamma)
    c_q, m_inv, c_k = _nystrom_factors(q, k, key_padding_mask, num_landmarks, mode, generator,
                                       exact_inverse, training, gamma)
    return c_q[:, :, select_rows(rows, q.shape[2], q.device)] @ m_inv @ c_k.transpose(-1, -2)


def skyformer_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                                  key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                                  generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                                  training: bool = True, causal: bool = False, gamma: float = GAMMA) -> Tensor:
    """The exact kernelized attention C V that Skyformer approximates (arguments validated, then unused)."""
    key_padding_mask = _check_args(q, k, v, key_padding_mask, num_landmarks, mode, generator, causal, gamma)
    return kernelized_attention_reference(q, k, v, key_padding_mask=key_padding_mask)

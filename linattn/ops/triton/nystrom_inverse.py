"""Skyformer's M^-1 by its iteration (Skyformer §4.4) in one kernel each way, as the custom ops
``linattn::nystrom_inverse`` and ``linattn::nystrom_inverse_backward``: what ``skyformer/inverse.py``'s
``inverse_forward`` and ``inverse_backward`` compute in about 40 and 90 batched (d×d) ATen ops, one program per head.

Forward, from the landmarks L (d,D) and the used slots: M = kappa(L, L) ⊙ keep + gamma I, S = diag(M 1)^(-1/2),
A = S M S, Z_0 = Aᵀ / (max column sum of A), Z' = Z (13I - P(15I - P(7I - P))) / 4 with P = A Z, and M^-1 ≈ S Z S.
It stores Z_0 .. Z_steps (the tape); the backward rebuilds M and A, each P = A Z from the tape, and runs the
iteration's own derivative back to dL/dL. A d×d matrix (64 KiB at d = 128) is too big for a program's registers
(held whole, it spills kilobytes a thread, and the backward's would need 320 KiB of shared memory, more than an
sm_90 block has): the matrices
live in a work area in global memory (each program's own, in L1 and L2 while it runs), and every product is a pass
over blocks of BLOCK rows, steps of BK along the inner dimension, then a barrier (``tl.debug_barrier``, which
also makes the block's global writes visible to its threads). Products of fp32 matrices by ``wide_dot``
(``LAUNCH``'s TF32: tf32x3 on tensor cores).
"""
from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import block, launch, wide_dot
from .kernel_op import kernel_op

STEPS = 6  # the iteration's steps, as ``skyformer/inverse.NEWTON_STEPS``


@triton.jit
def _kernel_rows(land_ptr, used_ptr, rows, L, D, gamma, BR: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr,
                 WIDE: tl.constexpr):
    """Rows ``rows`` (BR,) of M = kappa(L, L) ⊙ keep + gamma I (BR, BL), of kappa(L, L), and which entries M keeps
    (pairs of used slots, and the diagonal: an unused slot is an inert identity block); L (L, D) fp32 at land_ptr,
    the slots' 1 or 0 at used_ptr; 0 outside L."""
    cols = tl.arange(0, BL)
    dot = tl.zeros((BR, BL), tl.float32)
    sq_rows = tl.zeros((BR,), tl.float32)
    sq_cols = tl.zeros((BL,), tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(land_ptr + rows[:, None] * D + ks[None, :], mask=(rows[:, None] < L) & (ks[None, :] < D),
                    other=0.0)
        y = tl.load(land_ptr + cols[None, :] * D + ks[:, None], mask=(ks[:, None] < D) & (cols[None, :] < L),
                    other=0.0)
        dot += wide_dot(x, y, WIDE)
        sq_rows += tl.sum(x * x, 1)
        sq_cols += tl.sum(y * y, 0)
    # kappa(L, L) = exp(L Lᵀ - |L_i|²/2 - |L_j|²/2) (Skyformer §4.1), the exponent <= 0 but for rounding
    e = tl.exp(tl.minimum(dot - 0.5 * sq_rows[:, None] - 0.5 * sq_cols[None, :], 0.0))
    used_rows = tl.load(used_ptr + rows, mask=rows < L, other=0.0)
    used_cols = tl.load(used_ptr + cols, mask=cols < L, other=0.0)
    inside = (rows[:, None] < L) & (cols[None, :] < L)
    eye = inside & (rows[:, None] == cols[None, :])
    keep = inside & ((used_rows[:, None] * used_cols[None, :] > 0) | eye)
    return tl.where(keep, e, 0.0) + tl.where(eye, gamma, 0.0), e, keep  # (Skyformer §4.4)


@triton.jit
def _normalise(land_ptr, used_ptr, a_ptr, s_ptr, m_ptr, L, D, gamma, BR: tl.constexpr, BL: tl.constexpr,
               BK: tl.constexpr, WIDE: tl.constexpr, KEEP_M: tl.constexpr):
    """A = S M S into a_ptr (L, L), s = rowsum(M)^(-1/2) into s_ptr (L,) (and M into m_ptr if KEEP_M), in two passes
    over blocks of BR rows; returns A's column sums (BL,) and their max c. Ends with a barrier."""
    cols = tl.arange(0, BL)
    for rb in range(0, L, BR):
        rows = rb + tl.arange(0, BR)
        m, _, _ = _kernel_rows(land_ptr, used_ptr, rows, L, D, gamma, BR, BL, BK, WIDE)
        total = tl.sum(m, 1)  # every entry of M >= 0, its diagonal > 0
        tl.store(s_ptr + rows, 1.0 / tl.sqrt(tl.where(rows < L, total, 1.0)), mask=rows < L)
    tl.debug_barrier()
    s_cols = tl.load(s_ptr + cols, mask=cols < L, other=0.0)
    col_sums = tl.zeros((BL,), tl.float32)
    for rb in range(0, L, BR):
        rows, at, inside, _ = _rows(rb, L, BR, BL)
        m, _, _ = _kernel_rows(land_ptr, used_ptr, rows, L, D, gamma, BR, BL, BK, WIDE)
        a = m * tl.load(s_ptr + rows, mask=rows < L, other=0.0)[:, None] * s_cols[None, :]
        tl.store(a_ptr + at, a, mask=inside)
        if KEEP_M:
            tl.store(m_ptr + at, m, mask=inside)
        col_sums += tl.sum(a, 0)
    tl.debug_barrier()
    return col_sums, tl.max(col_sums, 0)


@triton.jit
def _product(x_ptr, y_ptr, rows, L, TX: tl.constexpr, TY: tl.constexpr, BR: tl.constexpr, BL: tl.constexpr,
             BK: tl.constexpr, WIDE: tl.constexpr):
    """Rows ``rows`` (BR,) of op(X) op(Y) (BR, BL) fp32 for X, Y (L, L) fp32 at x_ptr, y_ptr (op: the transpose
    where TX, TY), in steps of BK of the inner dimension; 0 outside L."""
    cols = tl.arange(0, BL)
    acc = tl.zeros((BR, BL), tl.float32)
    for k0 in range(0, L, BK):
        ks = k0 + tl.arange(0, BK)
        inner = ks < L
        at_x = ks[None, :] * L + rows[:, None] if TX else rows[:, None] * L + ks[None, :]
        at_y = cols[None, :] * L + ks[:, None] if TY else ks[:, None] * L + cols[None, :]
        x = tl.load(x_ptr + at_x, mask=(rows[:, None] < L) & inner[None, :], other=0.0)
        y = tl.load(y_ptr + at_y, mask=inner[:, None] & (cols[None, :] < L), other=0.0)
        acc += wide_dot(x, y, WIDE)
    return acc


@triton.jit
def _rows(rb, L, BR: tl.constexpr, BL: tl.constexpr):
    """Row block ``rb``: its rows (BR,), their offsets (BR, BL) in an (L, L) matrix, which are inside it, and I's
    rows (BR, BL)."""
    rows = rb + tl.arange(0, BR)
    cols = tl.arange(0, BL)
    inside = (rows[:, None] < L) & (cols[None, :] < L)
    return rows, rows[:, None] * L + cols[None, :], inside, tl.where(inside & (rows[:, None] == cols[None, :]), 1.0,
                                                                     0.0)


@triton.jit
def _p_pass(a_ptr, z_ptr, p_ptr, L, BR: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr):
    """P = A Z (L, L) into p_ptr, a pass over blocks of BR rows, then a barrier."""
    for rb in range(0, L, BR):
        rows, at, inside, _ = _rows(rb, L, BR, BL)
        tl.store(p_ptr + at, _product(a_ptr, z_ptr, rows, L, False, False, BR, BL, BK, WIDE), mask=inside)
    tl.debug_barrier()


@triton.jit
def _store_r2(p_ptr, r2_ptr, rows, at, inside, eye_rows, L, BR: tl.constexpr, BL: tl.constexpr, BK: tl.constexpr,
              WIDE: tl.constexpr):
    """Rows ``rows`` (offsets ``at``) of R2 = 15I - P (7I - P) = 15I - 7P + P P into r2_ptr (Skyformer §4.4)."""
    p = tl.load(p_ptr + at, mask=inside, other=0.0)
    r2 = _product(p_ptr, p_ptr, rows, L, False, False, BR, BL, BK, WIDE) - 7.0 * p + 15.0 * eye_rows
    tl.store(r2_ptr + at, r2, mask=inside)


@triton.jit
def _inverse(land_ptr, used_ptr, tape_ptr, work_ptr, out_ptr, gamma, H, L, D, STEPS: tl.constexpr,
             BL: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr):
    """One head: M^-1 ≈ S Z_steps S into out (L, L), Z_0 .. Z_steps into the tape (STEPS + 1, L, L); work: A, P, R2,
    R3 (4, L, L) and s (L,). Each product a pass over blocks of BLOCK rows, its operands read from the tape and the
    work area (on chip: L1, L2), a barrier after it: no thread holds a whole d×d matrix."""
    pid = tl.program_id(0)
    j = tl.arange(0, BL)
    square = L * L
    tape = tape_ptr + pid * (STEPS + 1) * square
    work = work_ptr + pid * (4 * square + L)
    a_at, p_at, r2_at, r3_at, s_at = work, work + square, work + 2 * square, work + 3 * square, work + 4 * square
    land, used = land_ptr + pid * L * D, used_ptr + (pid // H) * L
    col_sums, c = _normalise(land, used, a_at, s_at, a_at, L, D, gamma, BLOCK, BL, BK, WIDE, False)
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        tl.store(tape + at, tl.load(a_at + j[None, :] * L + rows[:, None], mask=inside, other=0.0) / c,
                 mask=inside)  # Z_0 = Aᵀ / c
    tl.debug_barrier()
    # Z' = Z R3, R3 = 13I/4 - P R2 / 4, R2 = 15I - P (7I - P) = 15I - 7P + P P, P = A Z (Skyformer §4.4)
    for t in range(STEPS):
        z_at = tape + t * square
        _p_pass(a_at, z_at, p_at, L, BLOCK, BL, BK, WIDE)
        for rb in range(0, L, BLOCK):
            rows, at, inside, eye_rows = _rows(rb, L, BLOCK, BL)
            _store_r2(p_at, r2_at, rows, at, inside, eye_rows, L, BLOCK, BL, BK, WIDE)
        tl.debug_barrier()
        for rb in range(0, L, BLOCK):
            rows, at, inside, eye_rows = _rows(rb, L, BLOCK, BL)
            r3 = 3.25 * eye_rows - 0.25 * _product(p_at, r2_at, rows, L, False, False, BLOCK, BL, BK, WIDE)
            tl.store(r3_at + at, r3, mask=inside)
        tl.debug_barrier()
        for rb in range(0, L, BLOCK):
            rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
            tl.store(z_at + square + at, _product(z_at, r3_at, rows, L, False, False, BLOCK, BL, BK, WIDE),
                     mask=inside)
        tl.debug_barrier()
    s = tl.load(s_at + j, mask=j < L, other=0.0)
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        s_rows = tl.load(s_at + rows, mask=rows < L, other=0.0)
        z = tl.load(tape + STEPS * square + at, mask=inside, other=0.0)
        tl.store(out_ptr + pid * square + at, z * s_rows[:, None] * s[None, :], mask=inside)


@triton.jit
def _inverse_grad(land_ptr, used_ptr, tape_ptr, work_ptr, grad_ptr, dland_ptr, gamma, H, L, D, STEPS: tl.constexpr,
                  BL: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr):
    """One head: dL/dL (L, D) from dL/dM^-1 (L, L), by the iteration's exact derivative (not that of M^-1); work:
    A, P, R2, R3, dR3 = Zᵀ dZ', F = Pᵀ dR3, W = -4 dP, dZ, -4 dA, M (10, L, L), s and a row sum (2, L); each
    pass as ``_inverse``'s."""
    pid = tl.program_id(0)
    j = tl.arange(0, BL)
    d = tl.arange(0, BD)
    square = L * L
    tape = tape_ptr + pid * (STEPS + 1) * square
    work = work_ptr + pid * (10 * square + 2 * L)
    a_at, p_at, r2_at, r3_at, ez_at = work, work + square, work + 2 * square, work + 3 * square, work + 4 * square
    f_at, w_at, gz_at, da_at = work + 5 * square, work + 6 * square, work + 7 * square, work + 8 * square
    m_at, s_at, sums_at = work + 9 * square, work + 10 * square, work + 10 * square + L
    land = land_ptr + pid * L * D
    used = used_ptr + (pid // H) * L
    grad = grad_ptr + pid * square
    col_sums, c = _normalise(land, used, a_at, s_at, m_at, L, D, gamma, BLOCK, BL, BK, WIDE, True)
    s = tl.load(s_at + j, mask=j < L, other=0.0)
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        s_rows = tl.load(s_at + rows, mask=rows < L, other=0.0)
        g = tl.load(grad + at, mask=inside, other=0.0)
        tl.store(gz_at + at, g * s_rows[:, None] * s[None, :], mask=inside)  # out = Z ⊙ s sᵀ
        tl.store(da_at + at, tl.zeros((BLOCK, BL), tl.float32), mask=inside)
    tl.debug_barrier()
    for back in range(STEPS):
        z_at = tape + (STEPS - 1 - back) * square
        _p_pass(a_at, z_at, p_at, L, BLOCK, BL, BK, WIDE)
        for rb in range(0, L, BLOCK):
            rows, at, inside, eye_rows = _rows(rb, L, BLOCK, BL)
            _store_r2(p_at, r2_at, rows, at, inside, eye_rows, L, BLOCK, BL, BK, WIDE)
            # dR3 = Zᵀ dZ'
            tl.store(ez_at + at, _product(z_at, gz_at, rows, L, True, False, BLOCK, BL, BK, WIDE), mask=inside)
        tl.debug_barrier()
        for rb in range(0, L, BLOCK):
            rows, at, inside, eye_rows = _rows(rb, L, BLOCK, BL)
            r3 = 3.25 * eye_rows - 0.25 * _product(p_at, r2_at, rows, L, False, False, BLOCK, BL, BK, WIDE)
            tl.store(r3_at + at, r3, mask=inside)
            # dR2 = -Pᵀ dR3 / 4 = -F / 4
            tl.store(f_at + at, _product(p_at, ez_at, rows, L, True, False, BLOCK, BL, BK, WIDE), mask=inside)
        tl.debug_barrier()
        for rb in range(0, L, BLOCK):
            rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
            # dP = -W / 4: -dR3 R2ᵀ / 4 - dR2 R1ᵀ, and -dR1 = Pᵀ dR2; with R1 = 7I - P, F R1ᵀ = 7F - F Pᵀ
            w = _product(ez_at, r2_at, rows, L, False, True, BLOCK, BL, BK, WIDE)
            w += _product(f_at, p_at, rows, L, False, True, BLOCK, BL, BK, WIDE)
            w += _product(p_at, f_at, rows, L, True, False, BLOCK, BL, BK, WIDE)
            tl.store(w_at + at, w - 7.0 * tl.load(f_at + at, mask=inside, other=0.0), mask=inside)
        tl.debug_barrier()
        for rb in range(0, L, BLOCK):
            rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
            # -4 dA = sum_t W_t Z_tᵀ; dZ through Z' = Z R3 and P = A Z: dZ' R3ᵀ - Aᵀ W / 4 (each row its own rows)
            da = tl.load(da_at + at, mask=inside, other=0.0)
            tl.store(da_at + at, da + _product(w_at, z_at, rows, L, False, True, BLOCK, BL, BK, WIDE), mask=inside)
            gz = _product(gz_at, r3_at, rows, L, False, True, BLOCK, BL, BK, WIDE)
            gz -= 0.25 * _product(a_at, w_at, rows, L, True, False, BLOCK, BL, BK, WIDE)
            tl.store(gz_at + at, gz, mask=inside)
        tl.debug_barrier()
    # Z_0 = Aᵀ / c, c = max_j sum_i A_ij (ties share the gradient, as autograd's amax)
    hit = tl.where((col_sums == c) & (j < L), 1.0, 0.0)
    dc = 0.0
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        w0 = tl.load(gz_at + j[None, :] * L + rows[:, None], mask=inside, other=0.0) / c
        dc += tl.sum(tl.sum(w0 * tl.load(a_at + at, mask=inside, other=0.0), 1), 0)
    dc = dc / (c * tl.sum(hit, 0))
    # A = M ⊙ s sᵀ, s_i = (sum_j M_ij)^(-1/2): dS = dOut ⊙ Z + dA ⊙ M, ds_i = sum_j (dS_ij + dS_ji) s_j
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        w0 = tl.load(gz_at + j[None, :] * L + rows[:, None], mask=inside, other=0.0) / c
        da = -0.25 * tl.load(da_at + at, mask=inside, other=0.0) + w0 - dc * hit[None, :]
        tl.store(da_at + at, da, mask=inside)
        dss = (tl.load(grad + at, mask=inside, other=0.0) * tl.load(tape + STEPS * square + at, mask=inside, other=0.0)
               + da * tl.load(m_at + at, mask=inside, other=0.0))
        tl.store(p_at + at, dss, mask=inside)
        tl.store(sums_at + rows, tl.sum(dss * s[None, :], 1), mask=rows < L)
    tl.debug_barrier()
    # M = kappa(L, L) ⊙ keep + gamma I, kappa = exp(E), E = L Lᵀ - |L_i|²/2 - |L_j|²/2 (Skyformer §4.1)
    for rb in range(0, L, BLOCK):
        rows, at, inside, _ = _rows(rb, L, BLOCK, BL)
        s_rows = tl.load(s_at + rows, mask=rows < L, other=0.0)
        ds = tl.load(sums_at + rows, mask=rows < L, other=0.0) + tl.sum(
            tl.load(p_at + j[None, :] * L + rows[:, None], mask=inside, other=0.0) * s[None, :], 1)
        dm = (tl.load(da_at + at, mask=inside, other=0.0) * s_rows[:, None] * s[None, :]
              - 0.5 * (ds * s_rows * s_rows * s_rows)[:, None])
        _, e, keep = _kernel_rows(land, used, rows, L, D, gamma, BLOCK, BL, BK, WIDE)
        tl.store(r2_at + at, tl.where(keep, dm * e, 0.0), mask=inside)
    tl.debug_barrier()
    # with G = dE + dEᵀ: dL = G L - rowsum(G) L
    for rb in range(0, L, BLOCK):
        rows = rb + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK, BD), tl.float32)
        total = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, L, BK):
            ks = k0 + tl.arange(0, BK)
            both = (rows[:, None] < L) & (ks[None, :] < L)
            g = (tl.load(r2_at + rows[:, None] * L + ks[None, :], mask=both, other=0.0)
                 + tl.load(r2_at + ks[None, :] * L + rows[:, None], mask=both, other=0.0))
            acc += wide_dot(g, tl.load(land + ks[:, None] * D + d[None, :], mask=(ks[:, None] < L) & (d[None, :] < D),
                                       other=0.0), WIDE)
            total += tl.sum(g, 1)
        rows_at = rows[:, None] * D + d[None, :]
        inside = (rows[:, None] < L) & (d[None, :] < D)
        tl.store(dland_ptr + pid * L * D + rows_at, acc - total[:, None] * tl.load(land + rows_at, mask=inside,
                                                                                    other=0.0), mask=inside)


@kernel_op("nystrom_inverse")
def nystrom_inverse(land: Tensor, used: Tensor, gamma: float) -> Tuple[Tensor, Tensor]:
    """land (B,H,L,D), the landmarks L, fp32; used (B,L) fp32 (1 or 0 per slot) -> M^-1 (B,H,L,L) fp32 for
    M = kappa(L, L) ⊙ keep + gamma I by the iteration, and its tape Z_0 .. Z_steps (B,H,STEPS+1,L,L) for
    ``nystrom_inverse_backward``."""
    b, h, num, d = land.shape
    land, used = land.contiguous(), used.contiguous()
    out, tape = _empty(land)
    work = land.new_empty((b * h, 4 * num * num + num))
    _inverse[(b * h,)](land, used, tape, work, out, gamma, h, num, d, STEPS=STEPS, BL=block(num),
                       **_blocks("nystrom_inverse", num, d))
    return out, tape


@torch.library.register_fake(nystrom_inverse)
def _(land, used, gamma):
    return _empty(land)


@kernel_op("nystrom_inverse_backward")
def nystrom_inverse_backward(land: Tensor, used: Tensor, gamma: float, tape: Tensor, grad: Tensor) -> Tensor:
    """dL/dL (B,H,L,D) fp32 from dL/dM^-1 ``grad`` (B,H,L,L) fp32 and ``nystrom_inverse``'s tape."""
    b, h, num, d = land.shape
    land, used = land.contiguous(), used.contiguous()
    dland = torch.empty_like(land)
    work = land.new_empty((b * h, 10 * num * num + 2 * num))
    _inverse_grad[(b * h,)](land, used, tape, work, grad.contiguous(), dland, gamma, h, num, d, STEPS=STEPS,
                            BL=block(num), BD=block(d), **_blocks("nystrom_inverse_grad", num, d))
    return dland


@torch.library.register_fake(nystrom_inverse_backward)
def _(land, used, gamma, tape, grad):
    return torch.empty_like(land.contiguous())


def _empty(land: Tensor) -> Tuple[Tensor, Tensor]:
    """Empty M^-1 (B,H,L,L) and tape (B,H,STEPS+1,L,L), fp32."""
    b, h, num, _ = land.shape
    return land.new_empty((b, h, num, num)), land.new_empty((b, h, STEPS + 1, num, num))


def _blocks(kernel: str, num: int, d: int) -> dict:
    """``kernel``'s launch settings, a BLOCK or BK of 0 (``common.INTERPRETED``) the whole of an (num, num) matrix
    (and of L's D columns)."""
    settings = launch(kernel, d)
    whole = max(block(num), block(d))
    return {**settings, "BLOCK": settings["BLOCK"] or block(num), "BK": settings["BK"] or whole}

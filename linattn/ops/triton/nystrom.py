"""Skyformer's Nyström apply out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) in two kernels, one sum and one small
product, as the custom op ``linattn::nystrom_apply``.

The kernel columns C = kappa(X_s, L) = exp(-|X_s - L|²/2) (Skyformer §4.1) are never stored: every program forms
its rows' (rows, d) block in registers, C = exp(D^(-1/2) (x·l - |x|²/2 - |l|²/2)) from the half rows x of Q or K and
the landmarks' half rows l (L = l D^(-1/4): the landmarks are rows of X, so l is exact in the inputs' half dtype),
x lᵀ on tensor cores with fp32 accumulation. C <= 1, so its products with half values run on tensor cores too.
``_state``, grid (B*H, cdiv(N, SPLIT_ROWS)): each program sums its rows' share of C^T W (W: the values, or in the
backward the output gradient), C^T formed as l xᵀ (``kernel_columns``), a step of BLOCK rows at a time; one ``sum``
over the split axis adds them (deterministic, no atomics). ``_readout``,
grid (B*H, cdiv(N, ROWS)): out = C_Q U per block of queries, U = M^-T T read in fp32 (``wide_dot``); the backward's
dV = C_K dT likewise over the keys.
Padding, as the parallel implementation: a padded key's row of C is 0, a padded query is a zero query.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    HALF,
    block,
    cdiv,
    each_in_layout,
    emulate_half_dot,
    half_dot,
    inputs_in_layout,
    launch,
    mask_bytes,
    new_rows,
    tile_at,
    wide_dot,
)
from .kernel_op import kernel_op

ROWS = 64  # queries per program of ``_readout`` (``_state``'s rows a step: its launch's BLOCK)
SPLIT_ROWS = 1024  # rows per program of ``_state`` and of the backward's two (a multiple of their BLOCKs)


@triton.jit
def landmarks(land_ptr, used_ptr, pid, H, L, D, s, j0, BL: tl.constexpr, BD: tl.constexpr, HALF_TY: tl.constexpr):
    """Landmarks j0 to j0 + BL of head ``pid`` (B*H order), stored (L, D) fp32 as L = l D^(-1/4): l (BL, BD) in
    HALF_TY (exact: the landmarks are rows of the half inputs), L itself (BL, BD) fp32, |l|² (BL,) and the used-slot
    factors (BL,) (1 or 0; 0 past L)."""
    j = j0 + tl.arange(0, BL)
    d = tl.arange(0, BD)
    land = tl.load(land_ptr + pid * L * D + j[:, None] * D + d[None, :], mask=(j[:, None] < L) & (d[None, :] < D),
                   other=0.0)
    raw = (land / s).to(HALF_TY)
    raw32 = raw.to(tl.float32)
    used = tl.load(used_ptr + (pid // H) * L + j, mask=j < L, other=0.0)
    return raw, land, tl.sum(raw32 * raw32, 1), used


@triton.jit
def kernel_rows(x_ptr, mask_ptr, BH, FAIRSEQ: tl.constexpr, pid, H, rows, end, D, SX, BD: tl.constexpr,
                HAS_MASK: tl.constexpr, KEYS: tl.constexpr):
    """Rows ``rows`` (< end) of Q or K (KEYS; fairseq's layout, head stride SX, or contiguous: ``common.tile_at``) of
    head ``pid``: x (R, BD) in its half dtype (a padded query 0), whether each row's C is live (0 on rows past the
    end and on padded keys) and whether each row is a real token."""
    d = tl.arange(0, BD)
    inside = rows < end
    real = inside
    if HAS_MASK:
        real = inside & (tl.load(mask_ptr + (pid // H) * end + rows, mask=inside, other=1) == 0)
    x = tl.load(x_ptr + tile_at(pid, rows, d, end, SX, BH, FAIRSEQ), mask=real[:, None] & (d[None, :] < D),
                other=0.0)
    live = real if KEYS else inside
    return x, live, real


@triton.jit
def square_norms(x):
    """|x|² (R,) fp32 of rows x (R, BD) (after their product with the landmarks: fewer registers live across it)."""
    x32 = x.to(tl.float32)
    return tl.sum(x32 * x32, 1)


@triton.jit
def gaussian(xl, x_sq, l_sq, used, s2, AXIS: tl.constexpr):
    """C = kappa(x_s, L) fp32 from x·l, rows by landmarks (AXIS 1: the landmarks' axis) or landmarks by rows (0),
    |x|² of the rows, |l|² and the used-slot factors of the landmarks (each broadcast where it is used: a
    landmark's broadcast takes a thread as many registers as its share of xl's columns)."""
    # E = x_s·L - |x_s|²/2 - |L|²/2 = D^(-1/2) (x·l - |x|²/2 - |l|²/2) <= 0 (Skyformer §4.1), clamped for rounding
    e = s2 * (xl - 0.5 * tl.expand_dims(x_sq, AXIS) - 0.5 * tl.expand_dims(l_sq, 1 - AXIS))
    return tl.exp(tl.minimum(e, 0.0)) * tl.expand_dims(used, 1 - AXIS)


@triton.jit
def kernel_block(x_ptr, mask_ptr, BH, FAIRSEQ: tl.constexpr, pid, H, rows, end, raw_t, raw_sq, used, s2, D, SX,
                 BD: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
                 KEYS: tl.constexpr):
    """Rows ``rows`` of Q or K (``kernel_rows``) of head ``pid``: x (R, BD) in HALF_TY, C = kappa(x_s, L) (R, BL)
    fp32 (0 on rows past the end and on padded keys; x lᵀ on tensor cores), and whether each row is a real token;
    raw_t: lᵀ (BD, BL) in HALF_TY, transposed before a loop over rows (transposed in the loop, l would be held in
    registers and stored to shared memory at every step)."""
    x, live, real = kernel_rows(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, end, D, SX, BD, HAS_MASK, KEYS)
    return x, columns(x, live, raw_t, raw_sq, used, s2, HALF_TY, EMULATE), real


@triton.jit
def columns(x, live, raw_t, raw_sq, used, s2, HALF_TY: tl.constexpr, EMULATE: tl.constexpr):
    """C = kappa(x_s, L) (R, BL) fp32 of rows x (R, BD) read by ``kernel_rows`` (0 where not ``live``) and the
    landmarks lᵀ (BD, BL) in HALF_TY, |l|² and used-slot factors (BL,) (``landmarks``): x lᵀ on tensor cores."""
    xl = half_dot(x, raw_t, HALF_TY, EMULATE)
    c = gaussian(xl, square_norms(x), raw_sq, used, s2, 1)
    return tl.where(live[:, None], c, 0.0)


@triton.jit
def kernel_columns(x_ptr, mask_ptr, BH, FAIRSEQ: tl.constexpr, pid, H, rows, end, raw, raw_sq, used, s2, D, SX,
                   BD: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
                   KEYS: tl.constexpr):
    """``kernel_block``'s x and C transposed, C^T (BL, R) fp32 (l xᵀ on tensor cores: the landmarks are its product's
    M, so that a product C^T W it feeds keeps one warp's rows to itself, as C's R = 64 rows at 8 warps do not), and
    whether each row is a real token."""
    x, live, real = kernel_rows(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, end, D, SX, BD, HAS_MASK, KEYS)
    lx = half_dot(raw, tl.trans(x), HALF_TY, EMULATE)
    ct = gaussian(lx, square_norms(x), raw_sq, used, s2, 0)
    return x, tl.where(live[None, :], ct, 0.0), real


@triton.jit
def _state(x_ptr, w_ptr, land_ptr, used_ptr, mask_ptr, part_ptr, BH, s, H, N, SPLIT, D, DV, SX, SW, L,
           BLOCK: tl.constexpr,
           BD: tl.constexpr, BDV: tl.constexpr, BL: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
           HAS_MASK: tl.constexpr, KEYS: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head: part (L, DV) = C^T W over its SPLIT rows of X (K if KEYS, else Q) and W (half), at head
    strides SX, SW (``common.tile_at``)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BDV)
    j = tl.arange(0, BL)
    raw, land, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, 0, BL, BD, HALF_TY)  # land: unused
    acc = tl.zeros((BL, BDV), tl.float32)
    first = tl.program_id(1) * SPLIT
    for start in range(first, tl.minimum(first + SPLIT, N), BLOCK):
        rows = start + tl.arange(0, BLOCK)
        _, ct, real = kernel_columns(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, N, raw, raw_sq, used, s * s, D,
                                     SX, BD, HALF_TY, EMULATE, HAS_MASK, KEYS)
        live = real if KEYS else rows < N  # a padded key's values reach nothing, whatever they hold
        w = tl.load(w_ptr + tile_at(pid, rows, e, N, SW, BH, FAIRSEQ), mask=live[:, None] & (e[None, :] < DV),
                    other=0.0)
        acc += half_dot(ct, w, HALF_TY, EMULATE)
    at = part_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * L * DV  # part (B, H, splits, L, DV)
    tl.store(at + j[:, None] * DV + e[None, :], acc, mask=(j[:, None] < L) & (e[None, :] < DV))


@triton.jit
def _readout(q_ptr, land_ptr, used_ptr, mask_ptr, u_ptr, out_ptr, BH, s, H, N, D, DV, SQ, SO, L,
             BLOCK: tl.constexpr,
             BD: tl.constexpr, BDV: tl.constexpr, BL: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
             HAS_MASK: tl.constexpr, KEYS: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One block of rows of Q, or of K (KEYS: a padded key's row of C is 0), of one head: out = C U (U (L, DV) fp32:
    M^-T T, or the backward's dT for dV), stored in q's dtype (q at head stride SQ, out at SO)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e = tl.arange(0, BDV)
    j = tl.arange(0, BL)
    raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, 0, BL, BD, HALF_TY)
    _, c, _ = kernel_block(q_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, N, tl.trans(raw), raw_sq, used, s * s, D, SQ,
                          BD, HALF_TY, EMULATE, HAS_MASK, KEYS)
    u = tl.load(u_ptr + pid * L * DV + j[:, None] * DV + e[None, :], mask=(j[:, None] < L) & (e[None, :] < DV),
                other=0.0)
    out = wide_dot(c, u, WIDE)
    tl.store(out_ptr + tile_at(pid, rows, e, N, SO, BH, FAIRSEQ), out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < N) & (e[None, :] < DV))


def kernel_readout(x: Tensor, u: Tensor, land: Tensor, used: Tensor, mask: Optional[Tensor], out: Tensor,
                   layout: Tuple[bool, int, int], keys: bool) -> None:
    """out (B,H,N,Dv) = C U for C = kappa(X_s, L) over all rows of x (B,H,N,D) (K if ``keys``: a padded key's row of C
    is 0; else Q) and u (B,H,L,Dv) fp32, stored into out in q's dtype; layout: (fairseq, x's head stride, out's)
    (``common.tile_at``); land (B,H,L,D), used (B,L) fp32 contiguous, mask (B,N) or None (True = padded)."""
    b, h, n, d = x.shape
    dv, num = u.shape[-1], land.shape[2]
    fairseq, sx, so = layout
    _readout[(b * h, cdiv(n, ROWS))](x, land, used, mask_bytes(mask, x), u, out, b * h, d ** -0.25, h, n, d, dv, sx,
                                     so, num, BLOCK=ROWS, BD=block(d), BDV=block(dv), BL=block(num),
                                     HALF_TY=HALF[x.dtype], EMULATE=emulate_half_dot(x.dtype),
                                     HAS_MASK=mask is not None, KEYS=keys, FAIRSEQ=fairseq,
                                     **launch("nystrom_readout", d))


def kernel_state(x: Tensor, w: Tensor, land: Tensor, used: Tensor, mask: Optional[Tensor], keys: bool) -> Tensor:
    """C^T W (B,H,L,Dv) fp32 for C = kappa(X_s, L) over all rows of x (B,H,N,D) (K if ``keys``, else Q) and w
    (B,H,N,Dv) half (fairseq's layout, packed too, or contiguous: read in place); land (B,H,L,D) fp32, used (B,L)
    fp32 factors, mask (B,N) or None (True = padded)."""
    b, h, n, d = x.shape
    fairseq, (sx, sw), (x, w) = each_in_layout(x, w)
    dv, num = w.shape[-1], land.shape[2]
    settings = launch("nystrom_state", d)  # its BLOCK: rows a step (C^T (L, BLOCK) in registers)
    assert SPLIT_ROWS % settings["BLOCK"] == 0, (SPLIT_ROWS, settings["BLOCK"])
    splits = max(1, cdiv(n, SPLIT_ROWS))
    part = land.new_empty((b, h, splits, num, dv))  # each split's share, summed below: deterministic, no atomics
    _state[(b * h, splits)](x, w, land, used, mask_bytes(mask, x), part, b * h, d ** -0.25, h, n, SPLIT_ROWS,
                            d, dv, sx, sw, num,
                            BD=block(d), BDV=block(dv), BL=block(num), HALF_TY=HALF[x.dtype],
                            EMULATE=emulate_half_dot(x.dtype), HAS_MASK=mask is not None, KEYS=keys, FAIRSEQ=fairseq,
                            **settings)
    return part.sum(2)


@kernel_op("nystrom_apply")
def nystrom_apply(q: Tensor, k: Tensor, v: Tensor, land: Tensor, m_inv: Tensor, used: Tensor,
                  mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k (B,H,N,D), v (B,H,N,Dv) half; land (B,H,L,D) the landmarks scaled by D^(-1/4) and m_inv (B,H,L,L) M^-1,
    fp32; used (B,L) fp32 (1 or 0 per slot); mask (B,N) or None -> out (B,H,N,Dv) in q's dtype and T = C_K^T V,
    U = M^-T T (B,H,L,Dv) fp32."""
    out = _empty(q, v)
    fairseq, sq, _, (q, k, v) = inputs_in_layout(q, k, v)
    land, used = land.contiguous(), used.contiguous()
    t = kernel_state(k, v, land, used, mask, keys=True)
    u = (m_inv.mT @ t).contiguous()
    kernel_readout(q, u, land, used, mask, out, (fairseq, sq, v.shape[-1]), keys=False)
    return out, t, u


@torch.library.register_fake(nystrom_apply)
def _(q, k, v, land, m_inv, used, mask):
    small = land.new_empty(land.shape[:3] + v.shape[3:])
    return _empty(q, v), small, torch.empty_like(small)


def _empty(q: Tensor, v: Tensor) -> Tensor:
    """The output: q's rows, v's width, q's layout (``common.new_rows``)."""
    return new_rows(q, v.shape[-1], q.dtype)


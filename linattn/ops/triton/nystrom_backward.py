"""The backward of Skyformer's Nyström apply (Skyformer eq. 6), the custom op ``linattn::nystrom_apply_backward``:
the parallel implementation's backward (``skyformer/parallel.backward``) with C rebuilt in registers.

dU = C_Q^T grad by the forward's ``_state`` over the queries, dT = M^-1 dU and dL/dM^-1 = T dU^T (small products);
then two kernels, each over the queries (A = grad, W = U) and the keys (A = V, W = dT) in one launch, grid
(B*H, cdiv(N, SPLIT_ROWS), 2), each forming dE = C ∘ (A W^T) a step of BLOCK rows at a time: ``_rows_grad``, per block
of rows dX_s = dE L - rowsum(dE) X_s; ``_landmarks_grad``, dE^T = C^T ∘ (W A^T) with the landmarks its products'
rows (as ``_state``'s C^T), each program's share of dL = dE^T X_s - colsum(dE) L, and one ``sum`` over both passes'
splits adds them (deterministic, no atomics); dV = C_K dT by the forward's ``_readout`` over the keys. Apart, none
holds another's tiles: the rows' kernel no (L, D) accumulator and no second layout of W, the landmarks' no dX, so
that each holds two blocks an SM at D = 64 (docs/design.md §1.3.1). dE, U and dT are unbounded: their products are
``wide_dot``'s.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import nystrom as forward
from .common import (
    HALF,
    block,
    cdiv,
    emulate_half_dot,
    inputs_in_layout,
    launch,
    mask_bytes,
    new_grads,
    op_grads,
    tile_at,
    wide_dot,
)
from .kernel_op import kernel_op
from .nystrom import kernel_block, kernel_columns, landmarks


@triton.jit
def factors(factor_ptr, pid, L, DV, BL: tl.constexpr, BDV: tl.constexpr):
    """W (BL, BDV) fp32 of head ``pid``, stored (L, DV): U or dT (0 outside)."""
    j = tl.arange(0, BL)
    e = tl.arange(0, BDV)
    return tl.load(factor_ptr + pid * L * DV + j[:, None] * DV + e[None, :], mask=(j[:, None] < L) & (e[None, :] < DV),
                   other=0.0)


@triton.jit
def _rows_grad(q_ptr, k_ptr, grad_ptr, v_ptr, u_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, dq_ptr, dk_ptr, BH, s, H,
               N, SPLIT, D, DV, SX, SG, SV, L, BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               BL: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
               WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head's queries (program_id(2) = 0: dq from grad and U) or keys (1: dk from V and dT), by
    ``rows_pass``; q, k, dq, dk at head stride SX, grad at SG, V at SV."""
    if tl.program_id(2) == 0:
        rows_pass(q_ptr, grad_ptr, u_ptr, land_ptr, used_ptr, mask_ptr, dq_ptr, BH, s, H, N, SPLIT, D, DV, SX, SG, L,
                  BLOCK, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, False, WIDE, FAIRSEQ)
    else:
        rows_pass(k_ptr, v_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, dk_ptr, BH, s, H, N, SPLIT, D, DV, SX, SV, L,
                  BLOCK, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, True, WIDE, FAIRSEQ)


@triton.jit
def rows_pass(x_ptr, a_ptr, factor_ptr, land_ptr, used_ptr, mask_ptr, dx_ptr, BH, s, H, N, SPLIT, D, DV, SX, SA, L,
              BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BL: tl.constexpr, HALF_TY: tl.constexpr,
              EMULATE: tl.constexpr, HAS_MASK: tl.constexpr, KEYS: tl.constexpr, WIDE: tl.constexpr,
              FAIRSEQ: tl.constexpr):
    """One split of the rows of Q, or of K (KEYS), of one head: dX (0 on padded rows), stored in the inputs' dtype;
    W (L, DV) fp32. X and dX (X = SX), A (SA) in fairseq's layout (FAIRSEQ) or contiguous."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, BL, BD, HALF_TY)  # L: its l D^(-1/4)
    raw_t = tl.trans(raw)  # lᵀ, once (``kernel_block``)
    w = factors(factor_ptr, pid, L, DV, BL, BDV)
    first = tl.program_id(1) * SPLIT
    for start in range(first, tl.minimum(first + SPLIT, N), BLOCK):
        rows = start + tl.arange(0, BLOCK)
        x, c, real = kernel_block(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, N, raw_t, raw_sq, used, s * s, D, SX,
                                  BD, HALF_TY, EMULATE, HAS_MASK, KEYS)
        live = real if KEYS else rows < N
        a = tl.load(a_ptr + tile_at(pid, rows, e, N, SA, BH, FAIRSEQ), mask=live[:, None] & (e[None, :] < DV),
                    other=0.0).to(tl.float32)
        # dE = dC ∘ C for C = exp(E), dC = A W^T; dX = D^(-1/4) dX_s, dX_s = dE L - rowsum(dE) X_s, X_s = x D^(-1/4)
        de = wide_dot(a, tl.trans(w), WIDE) * c
        dxs = wide_dot(de, raw.to(tl.float32), WIDE) - tl.sum(de, 1)[:, None] * x.to(tl.float32)  # dX_s D^(1/4)
        tl.store(dx_ptr + tile_at(pid, rows, d, N, SX, BH, FAIRSEQ),
                 tl.where(real[:, None], dxs * (s * s), 0.0).to(dx_ptr.dtype.element_ty),
                 mask=(rows[:, None] < N) & (d[None, :] < D))


@triton.jit
def _landmarks_grad(q_ptr, k_ptr, grad_ptr, v_ptr, u_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, part_ptr, BH, s, H,
                    N, SPLIT, D, DV, SX, SG, SV, L, BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                    BL: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
                    WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head's queries (program_id(2) = 0: grad and U) or keys (1: V and dT): its share of dL/dL by
    ``landmarks_pass``, into part (B*H, 2, splits, L, D); strides as ``_rows_grad``'s."""
    at = part_ptr + ((tl.program_id(0) * 2 + tl.program_id(2)) * tl.num_programs(1) + tl.program_id(1)) * L * D
    if tl.program_id(2) == 0:
        landmarks_pass(q_ptr, grad_ptr, u_ptr, land_ptr, used_ptr, mask_ptr, at, BH, s, H, N, SPLIT, D, DV, SX, SG,
                       L, BLOCK, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, False, WIDE, FAIRSEQ)
    else:
        landmarks_pass(k_ptr, v_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, at, BH, s, H, N, SPLIT, D, DV, SX, SV,
                       L, BLOCK, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, True, WIDE, FAIRSEQ)


@triton.jit
def landmarks_pass(x_ptr, a_ptr, factor_ptr, land_ptr, used_ptr, mask_ptr, at, BH, s, H, N, SPLIT, D, DV, SX, SA, L,
                   BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BL: tl.constexpr, HALF_TY: tl.constexpr,
                   EMULATE: tl.constexpr, HAS_MASK: tl.constexpr, KEYS: tl.constexpr, WIDE: tl.constexpr,
                   FAIRSEQ: tl.constexpr):
    """One split of the rows of Q, or of K (KEYS), of one head: the split's share of dL/dL (L, D) fp32, stored at
    ``at``; W (L, DV) fp32, X (SX) and A (SA) as ``rows_pass``'s."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    j = tl.arange(0, BL)
    raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, BL, BD, HALF_TY)  # L: read after the loop
    w = factors(factor_ptr, pid, L, DV, BL, BDV)
    dl = tl.zeros((BL, BD), tl.float32)
    col = tl.zeros((BL,), tl.float32)
    first = tl.program_id(1) * SPLIT
    for start in range(first, tl.minimum(first + SPLIT, N), BLOCK):
        rows = start + tl.arange(0, BLOCK)
        x, ct, real = kernel_columns(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, N, raw, raw_sq, used, s * s, D, SX,
                                     BD, HALF_TY, EMULATE, HAS_MASK, KEYS)
        live = real if KEYS else rows < N
        a = tl.load(a_ptr + tile_at(pid, rows, e, N, SA, BH, FAIRSEQ), mask=live[:, None] & (e[None, :] < DV),
                    other=0.0).to(tl.float32)
        # dE^T = C^T ∘ (W A^T); dL = dE^T X_s - colsum(dE) L, X_s = x D^(-1/4) (dE^T x summed: x half, exact in tf32)
        det = wide_dot(w, tl.trans(a), WIDE) * ct
        dl += wide_dot(det, x.to(tl.float32), WIDE)
        col += tl.sum(det, 1)
    tile = j[:, None] * D + d[None, :]
    inside = (j[:, None] < L) & (d[None, :] < D)
    land = tl.load(land_ptr + pid * L * D + tile, mask=inside, other=0.0)  # read here: no (L, D) tile held in the loop
    tl.store(at + tile, dl * s - col[:, None] * land, mask=inside)


@kernel_op("nystrom_apply_backward")
def nystrom_apply_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, land: Tensor, m_inv: Tensor,
                           used: Tensor, mask: Optional[Tensor], t: Tensor,
                           u: Tensor, pack: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk (B,H,N,D), dv (B,H,N,Dv) and their packed tensor (``common.op_grads``) in the inputs' dtype, dL/d(land)
    (B,H,L,D) and dL/dM^-1 (B,H,L,L) fp32, from dL/d(out) ``grad`` (q's dtype) and the forward's T, U
    (``nystrom.nystrom_apply``); ``pack`` as ``common.new_grads``'."""
    dq, dk, dv, packed = new_grads(q, k, v, pack)
    b, h, n, d = q.shape
    dv_dim, num = v.shape[-1], land.shape[2]
    fairseq, sqk, sv, (q, k, v, grad) = inputs_in_layout(q, k, v, grad.to(q.dtype), pack=pack)
    land, used = land.contiguous(), used.contiguous()
    du = forward.kernel_state(q, grad, land, used, mask, keys=False)
    dt = (m_inv @ du).contiguous()
    split_rows = forward.SPLIT_ROWS
    # their BLOCKs: rows a step (C and dE (BLOCK, L), or C^T and dE^T (L, BLOCK), in registers)
    rows_settings, land_settings = launch("nystrom_rows_grad", d, dv_dim), launch("nystrom_landmarks_grad", d, dv_dim)
    assert split_rows % rows_settings["BLOCK"] == 0 == split_rows % land_settings["BLOCK"], split_rows
    splits = max(1, cdiv(n, split_rows))
    part = land.new_empty((b, h, 2, splits, num, d))  # both passes' splits' dL/dL, summed below: no atomics
    args = (q, k, grad, v, u, dt, land, used, mask_bytes(mask, k))
    sizes = (b * h, d ** -0.25, h, n, split_rows, d, dv_dim, sqk, dv_dim, sv, num)
    consts = dict(BD=block(d), BDV=block(dv_dim), BL=block(num), HALF_TY=HALF[q.dtype],
                  EMULATE=emulate_half_dot(q.dtype), HAS_MASK=mask is not None, FAIRSEQ=fairseq)
    _rows_grad[(b * h, splits, 2)](*args, dq, dk, *sizes, **consts, **rows_settings)
    _landmarks_grad[(b * h, splits, 2)](*args, part, *sizes, **consts, **land_settings)
    forward.kernel_readout(k, dt, land, used, mask, dv, (fairseq, sqk, sv), keys=True)  # dV = C_K dT
    return (*op_grads(dq, dk, dv, packed), part.sum((2, 3)), t @ du.mT)


@torch.library.register_fake(nystrom_apply_backward)
def _(q, k, v, grad, land, m_inv, used, mask, t, u, pack):
    return (*op_grads(*new_grads(q, k, v, pack)), torch.empty_like(land), torch.empty_like(m_inv))

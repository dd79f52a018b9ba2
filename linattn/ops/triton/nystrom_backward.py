"""The backward of Skyformer's Nyström apply (Skyformer eq. 6), the custom op ``linattn::nystrom_apply_backward``:
the parallel implementation's backward (``skyformer/parallel.backward``) with C rebuilt in registers.

dU = C_Q^T grad by the forward's ``_state`` over the queries, dT = M^-1 dU and dL/dM^-1 = T dU^T (small products);
then two kernels, each over the queries (A = grad, W = U) and the keys (A = V, W = dT) in one launch, each forming
dE = C ∘ (A W^T) a step of BLOCK rows at a time: ``_rows_grad``, grid (B*H, cdiv(N, SPLIT_ROWS), 2), per block of
rows dX_s = dE L - rowsum(dE) X_s; ``_landmarks_grad``, grid (B*H*cdiv(L, BJ), cdiv(N, SPLIT_ROWS), 2), dE^T = C^T ∘
(W A^T) with the landmarks its products' rows (as ``_state``'s C^T), each program's share of its BJ landmarks' rows
of dL = dE^T X_s - colsum(dE) L (the programs' rows apart), and one ``sum`` over both passes' splits adds them
(deterministic, no atomics); dV = C_K dT by the forward's ``_readout`` over the keys. Apart, none holds another's
tiles: the rows' kernel no (L, D) accumulator, the landmarks' no dX. dE, U and dT are unbounded: their products are
``wide_dot``'s.

Both sums over the landmarks are additive over blocks of them, which is what keeps two blocks an SM at D = 128
(docs/design.md §1.3.1): with all 128 landmarks a program, ``_rows_grad`` held lᵀ in half, l and W (L, Dv) in fp32
as its products' operands (168 KiB of shared memory, one block an SM even on 16 warps) and ``_landmarks_grad``
its (L, D) fp32 accumulator with W (194-217 registers on 8 warps; spilling on 4). So at D = 128 (``LAUNCH_128``, 4
warps)
``_rows_grad`` takes 64 rows a step and walks the landmarks 16 at a time (BJ), each block's rows of L, |l|², the
used slots and W read again (from L2: about 2 KiB a row, against the 768 bytes a row it reads and writes in HBM)
and dE L, rowsum(dE) summed over the blocks (68 KiB of shared memory, 181-184 registers), and
``_landmarks_grad`` takes 64 landmarks a program (64 KiB, 196-246 registers), its programs of one head's rows
adjacent in the grid so that their second read of X and A comes from L2. At D = 64 (``LAUNCH``: BJ = L's block)
each reads its landmarks once, before its loop over rows (8 warps, 16 rows a step: 89-125 registers, 56-90 KiB).
dE = (W A^T)^T in ``_rows_grad``: A the product's shared-memory operand, not a 64-row fp32 tile in a thread's
registers across the blocks.
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
from .nystrom import columns, kernel_columns, kernel_rows, landmarks


@triton.jit
def factors(factor_ptr, pid, L, DV, j0, BL: tl.constexpr, BDV: tl.constexpr):
    """Rows j0 to j0 + BL of W (BL, BDV) fp32 of head ``pid``, stored (L, DV): U or dT (0 outside)."""
    j = j0 + tl.arange(0, BL)
    e = tl.arange(0, BDV)
    return tl.load(factor_ptr + pid * L * DV + j[:, None] * DV + e[None, :], mask=(j[:, None] < L) & (e[None, :] < DV),
                   other=0.0)


@triton.jit
def _rows_grad(q_ptr, k_ptr, grad_ptr, v_ptr, u_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, dq_ptr, dk_ptr, BH, s, H,
               N, SPLIT, D, DV, SX, SG, SV, L, BLOCK: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr,
               BDV: tl.constexpr, BL: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
               HAS_MASK: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head's queries (program_id(2) = 0: dq from grad and U) or keys (1: dk from V and dT), by
    ``rows_pass``; q, k, dq, dk at head stride SX, grad at SG, V at SV."""
    if tl.program_id(2) == 0:
        rows_pass(q_ptr, grad_ptr, u_ptr, land_ptr, used_ptr, mask_ptr, dq_ptr, BH, s, H, N, SPLIT, D, DV, SX, SG, L,
                  BLOCK, BJ, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, False, WIDE, FAIRSEQ)
    else:
        rows_pass(k_ptr, v_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, dk_ptr, BH, s, H, N, SPLIT, D, DV, SX, SV, L,
                  BLOCK, BJ, BD, BDV, BL, HALF_TY, EMULATE, HAS_MASK, True, WIDE, FAIRSEQ)


@triton.jit
def rows_pass(x_ptr, a_ptr, factor_ptr, land_ptr, used_ptr, mask_ptr, dx_ptr, BH, s, H, N, SPLIT, D, DV, SX, SA, L,
              BLOCK: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BL: tl.constexpr,
              HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr, KEYS: tl.constexpr,
              WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of the rows of Q, or of K (KEYS), of one head: dX (0 on padded rows), stored in the inputs' dtype;
    W (L, DV) fp32. With BJ >= BL the landmarks (l, lᵀ, |l|², their rows of W) are read once, before the loop over
    rows; else each step of BLOCK rows takes them BJ at a time, each block's rows of L and W read again (from L2),
    and sums dE L and rowsum(dE) over the blocks (dE's columns). X and dX (X = SX), A (SA) in fairseq's layout
    (FAIRSEQ) or contiguous."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    if BJ >= BL:
        raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, 0, BL, BD, HALF_TY)  # l: L D^(1/4)
        raw_t = tl.trans(raw)  # lᵀ, once (``kernel_block``)
        w = factors(factor_ptr, pid, L, DV, 0, BL, BDV)
    first = tl.program_id(1) * SPLIT
    for start in range(first, tl.minimum(first + SPLIT, N), BLOCK):
        rows = start + tl.arange(0, BLOCK)
        x, live, real = kernel_rows(x_ptr, mask_ptr, BH, FAIRSEQ, pid, H, rows, N, D, SX, BD, HAS_MASK, KEYS)
        a = tl.load(a_ptr + tile_at(pid, rows, e, N, SA, BH, FAIRSEQ), mask=live[:, None] & (e[None, :] < DV),
                    other=0.0).to(tl.float32)
        if BJ >= BL:
            dxs, total = block_grad(x, live, a, raw, raw_t, raw_sq, used, w, s * s, HALF_TY, EMULATE, WIDE)
        else:
            dxs = tl.zeros((BLOCK, BD), tl.float32)
            total = tl.zeros((BLOCK,), tl.float32)
            for j0 in range(0, L, BJ):  # dE's columns, a block of landmarks at a time: both sums are over them
                raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, j0, BJ, BD, HALF_TY)
                w = factors(factor_ptr, pid, L, DV, j0, BJ, BDV)
                part, sums = block_grad(x, live, a, raw, tl.trans(raw), raw_sq, used, w, s * s, HALF_TY, EMULATE,
                                        WIDE)
                dxs += part
                total += sums
            # x read again rather than held across the blocks (fewer registers); a padded row's, whatever it holds,
            # is dropped by the store's where
            x = tl.load(x_ptr + tile_at(pid, rows, d, N, SX, BH, FAIRSEQ), mask=(rows[:, None] < N) & (d[None, :] < D),
                        other=0.0)
        dxs -= total[:, None] * x.to(tl.float32)  # dX_s D^(1/4) = dE l - rowsum(dE) x: X_s = x D^(-1/4), L = l D^(-1/4)
        tl.store(dx_ptr + tile_at(pid, rows, d, N, SX, BH, FAIRSEQ),
                 tl.where(real[:, None], dxs * (s * s), 0.0).to(dx_ptr.dtype.element_ty),
                 mask=(rows[:, None] < N) & (d[None, :] < D))


@triton.jit
def block_grad(x, live, a, raw, raw_t, raw_sq, used, w, s2, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
               WIDE: tl.constexpr):
    """dE l (R, BD) fp32 and rowsum(dE) (R,) of rows x (R, BD) (``kernel_rows``: which are ``live``) over one block
    of landmarks (``landmarks``: l (BJ, BD) in HALF_TY, lᵀ, |l|², used-slot factors) and their rows of W (BJ, BDV)
    fp32; A (R, BDV) fp32."""
    # dE = dC ∘ C for C = exp(E), dC = A W^T = (W A^T)^T: A the product's B operand (in shared memory, not a
    # thread's registers across the blocks); dX = D^(-1/4) dX_s
    de = tl.trans(wide_dot(w, tl.trans(a), WIDE)) * columns(x, live, raw_t, raw_sq, used, s2, HALF_TY, EMULATE)
    return wide_dot(de, raw.to(tl.float32), WIDE), tl.sum(de, 1)


@triton.jit
def _landmarks_grad(q_ptr, k_ptr, grad_ptr, v_ptr, u_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, part_ptr, BH, s, H,
                    N, SPLIT, D, DV, SX, SG, SV, L, BLOCK: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr,
                    BDV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
                    WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head's queries (program_id(2) = 0: grad and U) or keys (1: V and dT), one block of BJ
    landmarks (program_id(0) = head * cdiv(L, BJ) + block): its share of those rows of dL/dL by ``landmarks_pass``,
    into part (B*H, 2, splits, L, D); strides as ``_rows_grad``'s."""
    blocks = tl.cdiv(L, BJ)
    pid = tl.program_id(0) // blocks
    j0 = tl.program_id(0) % blocks * BJ
    at = part_ptr + ((pid * 2 + tl.program_id(2)) * tl.num_programs(1) + tl.program_id(1)) * L * D
    if tl.program_id(2) == 0:
        landmarks_pass(q_ptr, grad_ptr, u_ptr, land_ptr, used_ptr, mask_ptr, at, pid, j0, BH, s, H, N, SPLIT, D, DV,
                       SX, SG, L, BLOCK, BJ, BD, BDV, HALF_TY, EMULATE, HAS_MASK, False, WIDE, FAIRSEQ)
    else:
        landmarks_pass(k_ptr, v_ptr, dt_ptr, land_ptr, used_ptr, mask_ptr, at, pid, j0, BH, s, H, N, SPLIT, D, DV,
                       SX, SV, L, BLOCK, BJ, BD, BDV, HALF_TY, EMULATE, HAS_MASK, True, WIDE, FAIRSEQ)


@triton.jit
def landmarks_pass(x_ptr, a_ptr, factor_ptr, land_ptr, used_ptr, mask_ptr, at, pid, j0, BH, s, H, N, SPLIT, D, DV,
                   SX, SA, L, BLOCK: tl.constexpr, BJ: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                   HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr, KEYS: tl.constexpr,
                   WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of the rows of Q, or of K (KEYS), of head ``pid``: the split's share of landmarks j0 to j0 + BJ's
    rows of dL/dL (L, D) fp32, stored at ``at``; W (L, DV) fp32, X (SX) and A (SA) as ``rows_pass``'s."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    j = j0 + tl.arange(0, BJ)
    raw, _, raw_sq, used = landmarks(land_ptr, used_ptr, pid, H, L, D, s, j0, BJ, BD, HALF_TY)  # L: after the loop
    w = factors(factor_ptr, pid, L, DV, j0, BJ, BDV)
    dl = tl.zeros((BJ, BD), tl.float32)
    col = tl.zeros((BJ,), tl.float32)
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
    # their BLOCKs: rows a step, BJs: landmarks a step or a program (C and dE (BLOCK, BJ), or C^T and dE^T (BJ,
    # BLOCK), in registers), at most L's block
    rows_settings, land_settings = (landmark_blocks(launch(key, d, dv_dim), num)
                                    for key in ("nystrom_rows_grad", "nystrom_landmarks_grad"))
    assert split_rows % rows_settings["BLOCK"] == 0 == split_rows % land_settings["BLOCK"], split_rows
    splits = max(1, cdiv(n, split_rows))
    part = land.new_empty((b, h, 2, splits, num, d))  # both passes' splits' dL/dL, summed below: no atomics
    args = (q, k, grad, v, u, dt, land, used, mask_bytes(mask, k))
    sizes = (b * h, d ** -0.25, h, n, split_rows, d, dv_dim, sqk, dv_dim, sv, num)
    consts = dict(BD=block(d), BDV=block(dv_dim), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype),
                  HAS_MASK=mask is not None, FAIRSEQ=fairseq)
    _rows_grad[(b * h, splits, 2)](*args, dq, dk, *sizes, BL=block(num), **consts, **rows_settings)
    _landmarks_grad[(b * h * cdiv(num, land_settings["BJ"]), splits, 2)](*args, part, *sizes, **consts,
                                                                         **land_settings)
    forward.kernel_readout(k, dt, land, used, mask, dv, (fairseq, sqk, sv), keys=True)  # dV = C_K dT
    return (*op_grads(dq, dk, dv, packed), part.sum((2, 3)), t @ du.mT)


def landmark_blocks(settings: dict, num: int) -> dict:
    """A backward kernel's launch ``settings`` with its BJ (landmarks a block) at most the block of ``num``
    landmarks."""
    return {**settings, "BJ": min(settings["BJ"], block(num))}


@torch.library.register_fake(nystrom_apply_backward)
def _(q, k, v, grad, land, m_inv, used, mask, t, u, pack):
    return (*op_grads(*new_grads(q, k, v, pack)), torch.empty_like(land), torch.empty_like(m_inv))

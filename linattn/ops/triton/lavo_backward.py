"""The backward of LAVO self-attention (LAVO §3; docs/design.md §6), the custom op ``linattn::lavo_backward``: the
parallel implementation's backward (``lavo/parallel.backward``) with both softmaxes recomputed in registers.

``_memory_grad``, grid (nw, B*H): per window, BLOCK rows a step, the memory softmax's backward (eq. 4): dL/dq from
F_global (stored fp32) and dL/dH per window. ``_bases_grad``, grid (B*H, cdiv(nw, SPLIT_WINDOWS), D / COLS):
each split's share of dL/dB, COLS of its columns, summed after (no atomics), the memory softmax recomputed (the
kernels apart, neither spills: the memory's tiles are held a base a row, (r, rows), and dL/dB's (r, D) accumulator
lives only in the second). The memory's small torch ops (``memory.memory_mean_grad``) turn dL/dH into dL/d(window
sums of F_local) and add the bases' share through the sums. ``_local_query_grad``, grid (nw, B*H): window m's
queries, BLOCK a step (dq, the bias' share). ``_local_grad``, grid (nw, B*H, D / COLS): COLS columns of window m's
keys' dk and dv: their contributions come from query window m and, causal, from window m + 1, whose rows the program
recomputes whole (the softmax needs every key a query sees), BLOCK queries a step; window m's keys sit in the last BW
slots in both. Each kernel recomputes the window softmax it needs (in one kernel they spilled), its products over D
BK columns a step (``lavo.rows_dot``: (keys, BK) operands, not (keys, D), so that 4 warps hold two blocks an SM
without a spill). dL/dF_local = coef grad + tok dL/d(window sum) is never
stored: dp = coef grad v^T (tensor cores, both half) + tok (v·dL/d(sum)).
"""
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..lavo.memory import memory_mean_grad
from .common import (
    HALF,
    block,
    cdiv,
    emulate_half_dot,
    half_dot,
    inputs_in_layout,
    new_grads,
    new_rows,
    op_grads,
    tile_at,
    wide_dot,
)
from .kernel_op import kernel_op
from .lavo import load_bases, memory_probs, memory_rows, rows_dot, sized, window_of, window_probs

SPLIT_WINDOWS = 16  # windows per program of ``_bases_grad``


@triton.jit
def _window_rows(q_ptr, grad_ptr, mean_ptr, order_ptr, pid, m, lo, d, BH, H, N, NW, W, R, D, SQK, ROWS: tl.constexpr,
                 BR: tl.constexpr, CAUSAL: tl.constexpr, FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """ROWS rows of window m of head ``pid`` from its row ``lo``: their positions t (ROWS,), their mask (ROWS, C), q
    (head stride SQK) and the output gradient (ROWS, C) half at the tokens' rows (through the order if ORDERED) and
    columns d (C,), and the window's memory's means H (BR,) (the window's if CAUSAL, else the sequence's)."""
    i = lo + tl.arange(0, ROWS)
    r = tl.arange(0, BR)
    t = m * W + i
    rows = ((i < W) & (t < N))[:, None] & (d[None, :] < D)
    tokens = memory_rows(order_ptr, pid, H, N, t, ORDERED)
    q = tl.load(q_ptr + tile_at(pid, tokens, d, N, SQK, BH, FAIRSEQ), mask=rows, other=0.0)
    g = tl.load(grad_ptr + tile_at(pid, tokens, d, N, D, BH, FAIRSEQ), mask=rows, other=0.0)
    mean = tl.load(mean_ptr + (pid * NW + m if CAUSAL else pid) * R + r, mask=r < R, other=0.0)
    return t, rows, q, g, mean


@triton.jit
def _memory_softmax_grad(q, g, bases, mean, scale, R, BR: tl.constexpr, HALF_TY: tl.constexpr,
                         EMULATE: tl.constexpr):
    """The memory softmax's backward (eq. 4) for rows q and their output gradient g (rows, BD) half, a base a row
    (``memory_probs(..., BY_BASE=True)``): (q B^T / sqrt(D))^T and p^T, dL/d(p ⊙ H)^T and the memory logits'
    gradient transposed, each (BR, rows) fp32."""
    qb, p = memory_probs(q, bases, mean, scale, R, BR, HALF_TY, EMULATE, True)
    dwgt = 0.5 * half_dot(bases, tl.trans(g), HALF_TY, EMULATE)  # dL/d(p ⊙ H)
    dp = dwgt * mean[:, None]
    dlog = p * (dp - tl.sum(dp * p, 0)[None, :])  # the memory logits' gradient
    return qb, p, dwgt, dlog


@triton.jit
def _memory_grad(q_ptr, grad_ptr, bases_ptr, mean_ptr, order_ptr, dqg_ptr, dmean_ptr, BH, H, N, NW, W, R, D, SQK,
                 scale, BW: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr,
                 HALF_TY: tl.constexpr, EMULATE: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr,
                 FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """Window m of head ``pid``, BLOCK rows a step: dL/dq of 0.5 F_global (BW, BD) fp32 at its positions' rows, and
    dL/dH (BR,) of its queries; q (head stride SQK) and grad at the tokens' rows (through the order if ORDERED); in
    fairseq's layout (FAIRSEQ) or contiguous."""
    m = tl.program_id(0)
    pid = tl.program_id(1)
    d = tl.arange(0, BD)
    r = tl.arange(0, BR)
    bases = load_bases(bases_ptr, pid, H, R, D, BR, BD)
    dmean = tl.zeros((BR,), tl.float32)
    for lo in range(0, BW, BLOCK):
        t, rows, q, g, mean = _window_rows(q_ptr, grad_ptr, mean_ptr, order_ptr, pid, m, lo, d, BH, H, N, NW, W, R,
                                           D, SQK, BLOCK, BR, CAUSAL, FAIRSEQ, ORDERED)
        qb, p, dwgt, dlog = _memory_softmax_grad(q, g, bases, mean, scale, R, BR, HALF_TY, EMULATE)
        dmean += tl.sum(dwgt * p + dlog * qb, 1)
        dqg = wide_dot(tl.trans(dlog * mean[:, None]), bases.to(tl.float32), WIDE) * scale
        tl.store(dqg_ptr + tile_at(pid, t, d, N, D, BH, FAIRSEQ), dqg, mask=rows)
    tl.store(dmean_ptr + (pid * NW + m) * R + r, dmean, mask=r < R)


@triton.jit
def _bases_grad(q_ptr, grad_ptr, bases_ptr, mean_ptr, order_ptr, part_ptr, BH, H, N, NW, W, R, D, SQK, SPLIT, scale,
                BW: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr,
                HALF_TY: tl.constexpr, EMULATE: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr,
                FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """One split of SPLIT windows of head ``pid``, COLS columns of D: part (R, COLS) fp32 = the split's share of
    those columns of dL/dB (eq. 4: through (p ⊙ H) B and through q B^T), its windows' memory softmax recomputed
    (``_memory_grad``'s, from all D columns) BLOCK rows a step."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    c = tl.program_id(2) * COLS + tl.arange(0, COLS)
    r = tl.arange(0, BR)
    bases = load_bases(bases_ptr, pid, H, R, D, BR, BD)
    db = tl.zeros((BR, COLS), tl.float32)
    STEPS: tl.constexpr = BW // BLOCK  # steps a window
    first = tl.program_id(1) * SPLIT
    for step in range(first * STEPS, tl.minimum(first + SPLIT, NW) * STEPS):
        m = step // STEPS
        lo = (step % STEPS) * BLOCK
        _, _, q, g, mean = _window_rows(q_ptr, grad_ptr, mean_ptr, order_ptr, pid, m, lo, d, BH, H, N, NW, W, R, D,
                                        SQK, BLOCK, BR, CAUSAL, FAIRSEQ, ORDERED)
        _, p, _, dlog = _memory_softmax_grad(q, g, bases, mean, scale, R, BR, HALF_TY, EMULATE)
        if COLS < BD:  # the program's columns of q and the output gradient
            _, _, q, g, _ = _window_rows(q_ptr, grad_ptr, mean_ptr, order_ptr, pid, m, lo, c, BH, H, N, NW, W, R, D,
                                         SQK, BLOCK, BR, CAUSAL, FAIRSEQ, ORDERED)
        db += 0.5 * wide_dot(p * mean[:, None], g.to(tl.float32), WIDE)  # through (p ⊙ H) B
        db += wide_dot(dlog * mean[:, None], q.to(tl.float32) * scale, WIDE)  # through q B^T
    at = part_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * R * D  # part (B, H, splits, R, D)
    tl.store(at + r[:, None] * D + c[None, :], db, mask=(r[:, None] < R) & (c[None, :] < D))


@triton.jit
def _query_grads(grad_ptr, dwin_ptr, BH, pid, N, NW, qw, q_rows, q_in, d, D, CAUSAL: tl.constexpr,
                 FAIRSEQ: tl.constexpr):
    """The output gradient (BW, C) half of query window ``qw``'s rows ``q_rows`` (those in the sequence: q_in) and
    dL/d(window sum) (C,) of its memory, at columns d (C,)."""
    g = tl.load(grad_ptr + tile_at(pid, q_rows, d, N, D, BH, FAIRSEQ), mask=q_in[:, None] & (d[None, :] < D),
                other=0.0)
    dwin = tl.load(dwin_ptr + (pid * NW + qw if CAUSAL else pid) * D + d, mask=d < D, other=0.0)
    return g, dwin


@triton.jit
def _window_softmax_grad(q_ptr, k_ptr, v_ptr, grad_ptr, bias_ptr, valid_ptr, order_ptr, coef_ptr, dwin_ptr, BH, pid,
                         H, N, NT, NW, W, qw, row, lo, hi, D, SQK, scale, BW: tl.constexpr, BD: tl.constexpr,
                         BK: tl.constexpr, ROWS: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
                         CAUSAL: tl.constexpr, FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """ROWS queries of window ``qw`` of head ``pid`` from its row ``row``, against the key slots from ``lo`` and
    ``hi`` (``window_probs``, a key a row): their positions t and rows in memory (ROWS,), which are in the sequence,
    the keys' rows in memory and real flags (NK,), p^T and the window softmax's backward ds^T (NK, ROWS) fp32, their
    real tokens tok (ROWS,) and F_local's weight coef; every product over D BK columns a step."""
    t, q_in, pos, real, pt, q_rows, k_rows = window_probs(
        q_ptr, k_ptr, bias_ptr, valid_ptr, order_ptr, BH, FAIRSEQ, pid, H, N, NT, W, qw, row, lo, hi, D, SQK, scale,
        BW, BD, BK, HALF_TY, EMULATE, CAUSAL, ORDERED, ROWS, True)
    coef = tl.load(coef_ptr + (pid // H) * NW + qw) if CAUSAL else tl.load(coef_ptr + pid // H)
    tok = tl.where(q_in & (tl.load(valid_ptr + (pid // H) * NT + t, mask=q_in, other=0) != 0), 1.0, 0.0)
    vd = tl.zeros((pt.shape[0],), tl.float32)  # v·dL/d(window sum) of each key
    for first in range(0, BD, BK):
        c = first + tl.arange(0, BK)
        v = tl.load(v_ptr + tile_at(pid, k_rows, c, N, SQK, BH, FAIRSEQ), mask=real[:, None] & (c[None, :] < D),
                    other=0.0)
        _, dwin = _query_grads(grad_ptr, dwin_ptr, BH, pid, N, NW, qw, q_rows, q_in, c, D, CAUSAL, FAIRSEQ)
        vd += tl.sum(v.to(tl.float32) * dwin[None, :], 1)
    # dL/dF_local = coef grad + tok dwin, so dp = coef grad v^T + tok (v·dwin) (here transposed)
    vg = rows_dot(v_ptr, k_rows, real, SQK, grad_ptr, q_rows, q_in, D, pid, N, D, BH, FAIRSEQ, BD, BK, HALF_TY,
                  EMULATE)
    dpt = coef * vg + vd[:, None] * tok[None, :]
    dst = pt * (dpt - tl.sum(dpt * pt, 0)[None, :])  # the window softmax's backward
    return t, q_rows, q_in, k_rows, real, pt, dst, tok, coef


@triton.jit
def _local_query_grad(q_ptr, k_ptr, v_ptr, grad_ptr, bias_ptr, valid_ptr, order_ptr, coef_ptr, dwin_ptr, dqg_ptr,
                      dq_ptr, dbias_ptr, BH, H, N, NT, NW, W, D, SQK, scale, BW: tl.constexpr, BD: tl.constexpr,
                      BLOCK: tl.constexpr, BK: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
                      CAUSAL: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """Window m of head ``pid``, BLOCK queries a step, BK columns of D a product's step: dq of its queries (with
    F_global's share, dqg) in the inputs' dtype and their share of the relative bias' gradient (dbias (B*H, nw,
    2w-1)). Every tensor of rows in fairseq's layout (FAIRSEQ; q, k, v and dq at X = SQK:
    ``common.inputs_in_layout``) or contiguous; q, k, v, grad and dq at the tokens' rows (through the order if
    ORDERED: ``lavo.memory_rows``), dqg at the positions'."""
    m = tl.program_id(0)
    pid = tl.program_id(1)
    NK: tl.constexpr = 2 * BW if CAUSAL else BW  # the key slots (``lavo.key_rows``)
    o = tl.arange(0, 2 * BW)
    lo = (m - 1) * W  # window m's previous window
    per = tl.zeros((2 * BW,), tl.float32)
    for row in range(0, BW, BLOCK):
        t, q_rows, q_in, k_rows, real, _, dst, _, _ = _window_softmax_grad(
            q_ptr, k_ptr, v_ptr, grad_ptr, bias_ptr, valid_ptr, order_ptr, coef_ptr, dwin_ptr, BH, pid, H, N, NT, NW,
            W, m, row, lo, m * W, D, SQK, scale, BW, BD, BK, BLOCK, HALF_TY, EMULATE, CAUSAL, FAIRSEQ, ORDERED)
        for first in range(0, BD, BK):
            c = first + tl.arange(0, BK)
            rows = q_in[:, None] & (c[None, :] < D)
            k = tl.load(k_ptr + tile_at(pid, k_rows, c, N, SQK, BH, FAIRSEQ), mask=real[:, None] & (c[None, :] < D),
                        other=0.0)
            dq = tl.load(dqg_ptr + tile_at(pid, t, c, N, D, BH, FAIRSEQ), mask=rows, other=0.0)
            dq += wide_dot(tl.trans(dst), k.to(tl.float32), WIDE) * scale
            tl.store(dq_ptr + tile_at(pid, q_rows, c, N, SQK, BH, FAIRSEQ), dq.to(dq_ptr.dtype.element_ty),
                     mask=rows)
        # the bias P[o] gets ds[key at t_i + o - w + 1, i]: the slots of that key, gathered per query
        key = t[None, :] + o[:, None] - W + 1
        hi = (key >= m * W) & (key < m * W + W)
        low = CAUSAL & (key >= lo) & (key < lo + W)
        slot = tl.where(hi, key - m * W + NK - BW, tl.where(low, key - lo, 0))
        per += tl.sum(tl.where(hi | low, tl.gather(dst, slot, 0), 0.0), 1)
    tl.store(dbias_ptr + (pid * NW + m) * (2 * W - 1) + o, per, mask=o < 2 * W - 1)


@triton.jit
def _own_slots(x, BW: tl.constexpr, CAUSAL: tl.constexpr):
    """x (NK, BW)'s rows of window m's keys, its last BW slots (causal: x[BW:]; non-causal: all of x), as a
    (BW, BW) tensor: window m's keys' gradients accumulate in BW rows, not NK."""
    if CAUSAL:
        _, x = tl.split(tl.permute(tl.reshape(x, (2, BW, x.shape[1])), (1, 2, 0)))
    return x


@triton.jit
def _local_grad(q_ptr, k_ptr, v_ptr, grad_ptr, bias_ptr, valid_ptr, order_ptr, coef_ptr, dwin_ptr, dk_ptr, dv_ptr,
                BH, H, N, NT, NW, W, D, SQK, scale, BW: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
                BK: tl.constexpr, COLS: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
                CAUSAL: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr, ORDERED: tl.constexpr):
    """Window m of head ``pid``: COLS columns of dk and dv of its keys, stored in the inputs' dtype, from query window
    m and, causal, window m + 1, whose rows the program recomputes whole (from all D columns, BK a product's step),
    BLOCK queries a step; window m's keys sit in the last BW slots in both. The softmax tiles are held a key a row,
    (NK, BLOCK). Layouts and rows as ``_local_query_grad``'s."""
    m = tl.program_id(0)
    pid = tl.program_id(1)
    c = tl.program_id(2) * COLS + tl.arange(0, COLS)
    dk = tl.zeros((BW, COLS), tl.float32)  # window m's keys: the last BW slots, in both steps
    dv = tl.zeros((BW, COLS), tl.float32)
    for step in tl.static_range(2 if CAUSAL else 1):
        qw = m + step
        if qw < NW:
            lo = (m - 1) * W if step == 0 else (m + 1) * W  # window m's previous window, or window m + 1 itself
            for row in range(0, BW, BLOCK):
                _, q_rows, q_in, _, _, pt, dst, tok, coef = _window_softmax_grad(
                    q_ptr, k_ptr, v_ptr, grad_ptr, bias_ptr, valid_ptr, order_ptr, coef_ptr, dwin_ptr, BH, pid, H,
                    N, NT, NW, W, qw, row, lo, m * W, D, SQK, scale, BW, BD, BK, BLOCK, HALF_TY, EMULATE, CAUSAL,
                    FAIRSEQ, ORDERED)
                # q, the output gradient and dL/d(window sum) at the program's columns
                q = tl.load(q_ptr + tile_at(pid, q_rows, c, N, SQK, BH, FAIRSEQ), mask=q_in[:, None] & (c[None, :] < D),
                            other=0.0)
                g, dwin = _query_grads(grad_ptr, dwin_ptr, BH, pid, N, NW, qw, q_rows, q_in, c, D, CAUSAL, FAIRSEQ)
                pt_own = _own_slots(pt, BW, CAUSAL)
                dv += coef * half_dot(pt_own, g, HALF_TY, EMULATE)
                dv += tl.sum(pt_own * tok[None, :], 1)[:, None] * dwin[None, :]
                dk += wide_dot(_own_slots(dst, BW, CAUSAL), q.to(tl.float32), WIDE) * scale
    j = tl.arange(0, BW)
    pos = m * W + j
    keys = ((j < W) & (pos < N))[:, None] & (c[None, :] < D)
    at = tile_at(pid, memory_rows(order_ptr, pid, H, N, pos, ORDERED), c, N, SQK, BH, FAIRSEQ)
    tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=keys)
    tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=keys)


@kernel_op("lavo_backward")
def lavo_backward(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, valid: Tensor, tok: Tensor,
                  order: Optional[Tensor], grad: Tensor, win: Tensor, mean: Tensor, coef: Tensor,
                  causal: bool, pack: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (B,H,N,D) and their packed tensor (``common.op_grads``) and dbases (H,r,D) in the inputs' dtype,
    dpos_bias (H,2w-1) fp32, from dL/d(out) ``grad`` (q's dtype) and what ``lavo.lavo`` saved (win, mean, coef);
    ``order`` as ``lavo.lavo``'s, ``pack`` as ``common.new_grads``'."""
    b, h, n, d = q.shape
    w, r = window_of(pos_bias), bases.shape[1]
    nw = tok.shape[1] // w
    dq, dk, dv, packed = new_grads(q, k, v, pack)
    dqg = new_rows(q, d, torch.float32)  # dL/dq from F_global, in q's layout
    fairseq, sqk, _, (q, k, v, grad) = inputs_in_layout(q, k, v, grad.to(q.dtype), pack=pack)  # D = Dv: v at SQK too
    bases, pos_bias, valid = bases.contiguous(), pos_bias.contiguous(), valid.contiguous()
    sizes = dict(BW=block(w), BD=block(d), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), CAUSAL=causal,
                 FAIRSEQ=fairseq, ORDERED=order is not None)
    order = valid if order is None else order.contiguous()  # never read without an order
    dmean = q.new_empty((b, h, nw, r), dtype=torch.float32)
    splits = cdiv(nw, SPLIT_WINDOWS)
    part = q.new_empty((b, h, splits, r, d), dtype=torch.float32)  # each split's dL/dB: no atomics
    memory = (q, grad, bases, mean.contiguous(), order)
    _memory_grad[(nw, b * h)](*memory, dqg, dmean, b * h, h, n, nw, w, r, d, sqk, 1 / math.sqrt(d), BR=block(r),
                              **sizes, **sized("lavo_memory_grad", d, sizes["BW"]))
    bases_cols = sized("lavo_bases_grad", d, sizes["BW"])
    _bases_grad[(b * h, splits, cdiv(d, bases_cols["COLS"]))](*memory, part, b * h, h, n, nw, w, r, d, sqk,
                                                              SPLIT_WINDOWS, 1 / math.sqrt(d), BR=block(r), **sizes,
                                                              **bases_cols)
    dbases = part.sum((0, 2))
    dwin = memory_mean_grad(dmean if causal else dmean.sum(2), win, bases.float(), dbases, tok.view(b, nw, w), causal)
    dbias = q.new_empty((b, h, nw, 2 * w - 1), dtype=torch.float32)
    local = (q, k, v, grad, pos_bias, valid, order, coef.contiguous(), dwin.contiguous())
    shape = (b * h, h, n, valid.shape[1], nw, w, d, sqk, 1 / math.sqrt(d))
    _local_query_grad[(nw, b * h)](*local, dqg, dq, dbias, *shape, **sizes,
                                   **sized("lavo_local_query_grad", d, sizes["BW"]))
    key_cols = sized("lavo_local_grad", d, sizes["BW"])
    _local_grad[(nw, b * h, cdiv(d, key_cols["COLS"]))](*local, dk, dv, *shape, **sizes, **key_cols)
    return (*op_grads(dq, dk, dv, packed), dbases.to(bases.dtype), dbias.sum((0, 2)))


@torch.library.register_fake(lavo_backward)
def _(q, k, v, bases, pos_bias, valid, tok, order, grad, win, mean, coef, causal, pack):
    return (*op_grads(*new_grads(q, k, v, pack)), torch.empty_like(bases),
            pos_bias.new_empty(pos_bias.shape, dtype=torch.float32))

"""LAVO self-attention (LAVO §3; docs/design.md §6) in two kernels around the memory's small torch ops, as the
custom op ``linattn::lavo``.

``_local``, grid (nw, B*H): window m's queries, BLOCK a step, against the keys they may see, in registers: scores
on tensor cores from the half q and k (BK columns of D a step: ``rows_dot``), plus the relative bias
P[j - t + w - 1] (§3.3), softmax over the allowed keys, F_local = p V on tensor cores (p <= 1), stored in fp32 with
the window's sum over its real tokens. The memory's means H (eq. 3: an exclusive cumulative sum over the windows if
causal, the total if not) are ``memory.memory_mean``'s torch ops on the (B,H,nw,D) sums. ``_memory``, grid
(nw, B*H), BLOCK rows a step: F_global = softmax(q B^T ⊙ H / sqrt(D)) (H ⊙ B) (eq. 4) and the output
0.5 (F_local + F_global) (F_local alone without memory), in q's dtype.

The keys a window's queries see sit in NK slots (BW = the window's block): causal, NK = 2 BW, slots [0, BW) from
position ``lo`` (query window m's previous window) and [BW, 2 BW) from ``hi`` (its own); non-causal, NK = BW slots
from ``hi`` (its own window). The backward reads them in another order (``lavo_backward``), so a key's bias and mask
come from its position, never from its slot.
"""
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..lavo.memory import memory_mean
from .common import HALF, block, emulate_half_dot, half_dot, inputs_in_layout, launch, new_rows, tile_at, wide_dot
from .kernel_op import kernel_op


@triton.jit
def memory_rows(order_ptr, pid, H, N, pos, ORDERED: tl.constexpr):
    """The rows in memory of positions ``pos`` of head ``pid``'s sequence: with ORDERED, positions in its real-first
    order (``order`` (B, N) int32, ``real_tokens``), order[b, pos]; else pos. Outside [0, N) row 0 (masked there)."""
    if ORDERED:
        return tl.load(order_ptr + (pid // H) * N + pos, mask=(pos >= 0) & (pos < N), other=0)
    return pos


@triton.jit
def key_rows(valid_ptr, pid, H, N, NT, W, lo, hi, BW: tl.constexpr, CAUSAL: tl.constexpr):
    """The NK key slots and their positions (causal, slots [0, BW) from ``lo`` and [BW, 2 BW) from ``hi``;
    else BW slots from ``hi``; W of each half in use) and whether each holds a real key (inside the sequence, not
    padded; valid (B, NT) uint8)."""
    NK: tl.constexpr = 2 * BW if CAUSAL else BW
    j = tl.arange(0, NK)
    low = j < NK - BW
    pos = tl.where(low, lo + j, hi + j - (NK - BW))
    used = tl.where(low, j < W, (j - (NK - BW)) < W)
    inside = used & (pos >= 0) & (pos < N)
    real = inside & (tl.load(valid_ptr + (pid // H) * NT + pos, mask=inside, other=0) != 0)
    return pos, real


@triton.jit
def rows_dot(a_ptr, a_rows, a_in, XA, b_ptr, b_rows, b_in, XB, pid, N, D, BH, FAIRSEQ: tl.constexpr,
             BD: tl.constexpr, BK: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr):
    """a b^T (M, N) fp32 of the rows ``a_rows`` (M,) of a and ``b_rows`` (N,) of b, (B,H,·,D) half at head strides
    XA and XB (``tile_at``), rows outside a_in and b_in 0: on tensor cores, BK columns of D a step (operands of
    (rows, BK) in registers, not (rows, BD))."""
    acc = tl.zeros((a_rows.shape[0], b_rows.shape[0]), tl.float32)
    for first in range(0, BD, BK):
        c = first + tl.arange(0, BK)
        a = tl.load(a_ptr + tile_at(pid, a_rows, c, N, XA, BH, FAIRSEQ), mask=a_in[:, None] & (c[None, :] < D),
                    other=0.0)
        b = tl.load(b_ptr + tile_at(pid, b_rows, c, N, XB, BH, FAIRSEQ), mask=b_in[:, None] & (c[None, :] < D),
                    other=0.0)
        acc += half_dot(a, tl.trans(b), HALF_TY, EMULATE)
    return acc


@triton.jit
def window_probs(q_ptr, k_ptr, bias_ptr, valid_ptr, order_ptr, BH, FAIRSEQ: tl.constexpr, pid, H, N, NT, W, qw, row,
                 lo, hi, D, SQK, scale, BW: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, HALF_TY: tl.constexpr,
                 EMULATE: tl.constexpr, CAUSAL: tl.constexpr, ORDERED: tl.constexpr, ROWS: tl.constexpr,
                 BY_KEY: tl.constexpr = False):
    """ROWS queries of window ``qw`` of head ``pid``, from its row ``row``, against the key slots (``key_rows``):
    their positions t (ROWS,) and which are in the sequence, the keys' positions and real flags (NK,), and p
    (ROWS, NK) fp32, the window softmax of q·k/sqrt(D) + P[j - t + w - 1] over the allowed keys (LAVO §3.2-3.3), 0
    elsewhere and on rows with no allowed key (a query's row needs only its own scores: ROWS < BW steps a window's
    queries in fewer registers); BY_KEY: p transposed, (NK, ROWS), a key a row (its scores k q^T: NK = 2 BW rows
    causal, which 8 warps hold without replicating them, ``dev.perf.binary.replicated_dots``); and the queries' and
    keys' rows in memory (``memory_rows``). The scores from the half q and k at head stride SQK, BK columns of D a
    step (``rows_dot``)."""
    i = row + tl.arange(0, ROWS)
    t = qw * W + i
    q_in = (i < W) & (t < N)
    q_rows = memory_rows(order_ptr, pid, H, N, t, ORDERED)
    pos, real = key_rows(valid_ptr, pid, H, N, NT, W, lo, hi, BW, CAUSAL)
    k_rows = memory_rows(order_ptr, pid, H, N, pos, ORDERED)
    KEYS: tl.constexpr = 0 if BY_KEY else 1  # the axis of the keys
    if BY_KEY:
        rel = pos[:, None] - t[None, :]
        seen_by = real[:, None] & q_in[None, :]
        own = (pos[:, None] // W) == qw
        qk = rows_dot(k_ptr, k_rows, real, SQK, q_ptr, q_rows, q_in, SQK, pid, N, D, BH, FAIRSEQ, BD, BK, HALF_TY,
                      EMULATE)
    else:
        rel = pos[None, :] - t[:, None]
        seen_by = real[None, :] & q_in[:, None]
        own = (pos[None, :] // W) == qw
        qk = rows_dot(q_ptr, q_rows, q_in, SQK, k_ptr, k_rows, real, SQK, pid, N, D, BH, FAIRSEQ, BD, BK, HALF_TY,
                      EMULATE)
    allowed = seen_by & ((rel <= 0) & (rel > -W) if CAUSAL else own)  # keys t-w+1..t, or the own window
    bias = tl.load(bias_ptr + (pid % H) * (2 * W - 1) + rel + W - 1, mask=allowed, other=0.0)
    s = tl.where(allowed, qk * scale + bias, float("-inf"))
    top = tl.max(s, KEYS)
    seen = top > float("-inf")
    e = tl.exp(s - tl.expand_dims(tl.where(seen, top, 0.0), KEYS))  # exp(-inf) = 0 off the allowed keys
    p = e / tl.expand_dims(tl.where(seen, tl.sum(e, KEYS), 1.0), KEYS)
    return t, q_in, pos, real, p, q_rows, k_rows


@triton.jit
def _local(q_ptr, k_ptr, v_ptr, bias_ptr, valid_ptr, order_ptr, xl_ptr, win_ptr, BH, H, N, NT, NW, W, D, SQK,
           scale, BW: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
           HALF_TY: tl.constexpr, EMULATE: tl.constexpr, CAUSAL: tl.constexpr, FAIRSEQ: tl.constexpr,
           ORDERED: tl.constexpr):
    """Window m of head ``pid``, BLOCK queries a step (their scores BK columns of D a step): F_local (BW, BD)
    stored fp32 at its positions' rows, and its sum over the window's real tokens; q, k, v (head stride SQK, read
    through the order if ORDERED: ``memory_rows``) and F_local in fairseq's layout (FAIRSEQ) or contiguous
    (``common.tile_at``)."""
    m = tl.program_id(0)
    pid = tl.program_id(1)
    d = tl.arange(0, BD)
    win = tl.zeros((BD,), tl.float32)
    for row in range(0, BW, BLOCK):
        t, q_in, pos, real, p, _, k_rows = window_probs(
            q_ptr, k_ptr, bias_ptr, valid_ptr, order_ptr, BH, FAIRSEQ, pid, H, N, NT, W, m, row, (m - 1) * W, m * W,
            D, SQK, scale, BW, BD, BK, HALF_TY, EMULATE, CAUSAL, ORDERED, BLOCK)
        v = tl.load(v_ptr + tile_at(pid, k_rows, d, N, SQK, BH, FAIRSEQ), mask=real[:, None] & (d[None, :] < D),
                    other=0.0)
        xl = half_dot(p, v, HALF_TY, EMULATE)
        tl.store(xl_ptr + tile_at(pid, t, d, N, D, BH, FAIRSEQ), xl, mask=q_in[:, None] & (d[None, :] < D))
        tok = q_in & (tl.load(valid_ptr + (pid // H) * NT + t, mask=q_in, other=0) != 0)
        win += tl.sum(tl.where(tok[:, None], xl, 0.0), 0)
    tl.store(win_ptr + (pid * NW + m) * D + d, win, mask=d < D)


@triton.jit
def load_bases(bases_ptr, pid, H, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """The bases (BR, BD) of head ``pid`` (B*H order) as stored (H, R, D), 0 outside."""
    r = tl.arange(0, BR)
    d = tl.arange(0, BD)
    inside = (r[:, None] < R) & (d[None, :] < D)
    return tl.load(bases_ptr + (pid % H) * R * D + r[:, None] * D + d[None, :], mask=inside, other=0.0)


@triton.jit
def memory_probs(q, bases, mean, scale, R, BR: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
                 BY_BASE: tl.constexpr = False):
    """q B^T / sqrt(D) (rows, BR) on tensor cores from the half q and bases, and the memory softmax
    p = softmax(q B^T ⊙ H / sqrt(D)) over the r bases (LAVO eq. 4; q·Xtil_i = H_i q·B_i); BY_BASE: both transposed,
    (BR, rows), a base a row (B q^T: BR = 128 rows at D = 128, which 8 warps hold without replicating them,
    ``dev.perf.binary.replicated_dots``)."""
    BASES: tl.constexpr = 0 if BY_BASE else 1  # the axis of the bases
    if BY_BASE:
        qb = half_dot(bases, tl.trans(q), HALF_TY, EMULATE) * scale
        s = tl.where(tl.arange(0, BR)[:, None] < R, qb * mean[:, None], float("-inf"))
    else:
        qb = half_dot(q, tl.trans(bases), HALF_TY, EMULATE) * scale
        s = tl.where(tl.arange(0, BR)[None, :] < R, qb * mean[None, :], float("-inf"))
    e = tl.exp(s - tl.expand_dims(tl.max(s, BASES), BASES))
    return qb, e / tl.expand_dims(tl.sum(e, BASES), BASES)


@triton.jit
def _memory(q_ptr, bases_ptr, mean_ptr, coef_ptr, xl_ptr, order_ptr, out_ptr, BH, H, N, NW, W, R, D, SQK, scale,
            BW: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr, HALF_TY: tl.constexpr,
            EMULATE: tl.constexpr, CAUSAL: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr,
            ORDERED: tl.constexpr):
    """Window m of head ``pid``, BLOCK rows a step: out = coef F_local + 0.5 (p ⊙ H) B (eq. 4) in q's dtype;
    coef = 0.5 with a memory, 1 without (then H = 0); q (head stride SQK) and out at the tokens' rows (through the
    order if ORDERED), F_local at the positions'; in fairseq's layout (FAIRSEQ) or contiguous."""
    m = tl.program_id(0)
    pid = tl.program_id(1)
    d = tl.arange(0, BD)
    r = tl.arange(0, BR)
    bases = load_bases(bases_ptr, pid, H, R, D, BR, BD)
    at = pid * NW + m if CAUSAL else pid  # the window's memory, or the sequence's
    mean = tl.load(mean_ptr + at * R + r, mask=r < R, other=0.0)
    coef = tl.load(coef_ptr + (pid // H) * NW + m) if CAUSAL else tl.load(coef_ptr + pid // H)
    for row in range(0, BW, BLOCK):
        i = row + tl.arange(0, BLOCK)
        t = m * W + i
        rows = ((i < W) & (t < N))[:, None] & (d[None, :] < D)
        tokens = memory_rows(order_ptr, pid, H, N, t, ORDERED)
        q = tl.load(q_ptr + tile_at(pid, tokens, d, N, SQK, BH, FAIRSEQ), mask=rows, other=0.0)
        _, p = memory_probs(q, bases, mean, scale, R, BR, HALF_TY, EMULATE)
        glob = wide_dot(p * (0.5 * mean)[None, :], bases.to(tl.float32), WIDE)
        xl = tl.load(xl_ptr + tile_at(pid, t, d, N, D, BH, FAIRSEQ), mask=rows, other=0.0)
        out = (coef * xl + glob).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tile_at(pid, tokens, d, N, D, BH, FAIRSEQ), out, mask=rows)


def sized(kernel: str, d: int, bw: int) -> dict:
    """``launch(kernel, d)`` with its BLOCK (rows a step), if any, at most a window's block ``bw`` and its BK
    (columns of D a product's step) and COLS (columns of D a program), if any, at most D's block."""
    settings = launch(kernel, d)
    if "BLOCK" in settings:
        settings["BLOCK"] = min(settings["BLOCK"], bw)
    for cols in ("BK", "COLS"):
        if cols in settings:
            settings[cols] = min(settings[cols], block(d))
    return settings


def window_of(pos_bias: Tensor) -> int:
    """w from the relative bias (H, 2w - 1)."""
    return (pos_bias.shape[1] + 1) // 2


@kernel_op("lavo")
def lavo(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, valid: Tensor, tok: Tensor,
         order: Optional[Tensor], causal: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (B,H,N,D) and bases (H,r,D) half, one dtype; pos_bias (H,2w-1) fp32; valid (B,nw*w) uint8 and tok
    (B,nw*w) fp32, the real tokens by position; ``order`` (B,N) int32, each row's real-first order (``real_tokens``),
    whose positions the windows count and through which q, k, v and out are read and written, or None (the tokens'
    own) -> out (B,H,N,D) in q's dtype, and for the backward the window sums of F_local (B,H,nw,D) and the memory's
    means and F_local's weights (``memory.memory_mean``), fp32."""
    b, h, n, d = q.shape
    w, r = window_of(pos_bias), bases.shape[1]
    nw = tok.shape[1] // w
    out = new_rows(q, d, q.dtype)
    xl = new_rows(q, d, torch.float32)  # F_local, in q's layout
    fairseq, sqk, _, (q, k, v) = inputs_in_layout(q, k, v)  # D = Dv: v at q's and k's head stride
    bases, pos_bias, valid = bases.contiguous(), pos_bias.contiguous(), valid.contiguous()
    win = q.new_empty((b, h, nw, d), dtype=torch.float32)
    sizes = dict(BW=block(w), BD=block(d), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), CAUSAL=causal,
                 FAIRSEQ=fairseq, ORDERED=order is not None)
    order = valid if order is None else order.contiguous()  # never read without an order
    _local[(nw, b * h)](q, k, v, pos_bias, valid, order, xl, win, b * h, h, n, valid.shape[1], nw, w, d, sqk,
                        1 / math.sqrt(d), **sizes, **sized("lavo_local", d, sizes["BW"]))
    mean, coef, _ = memory_mean(win, bases.float(), tok.view(b, nw, w), causal)
    _memory[(nw, b * h)](q, bases, mean.contiguous(), coef.contiguous(), xl, order, out, b * h, h, n, nw, w, r, d,
                         sqk, 1 / math.sqrt(d), BR=block(r), **sizes, **sized("lavo_memory", d, sizes["BW"]))
    return out, win, mean, coef


@torch.library.register_fake(lavo)
def _(q, k, v, bases, pos_bias, valid, tok, order, causal):
    b, h, _, d = q.shape
    nw = tok.shape[1] // window_of(pos_bias)
    f32 = dict(dtype=torch.float32)
    mean = q.new_empty((b, h, nw, bases.shape[1]) if causal else (b, h, bases.shape[1]), **f32)
    coef = q.new_empty((b, nw) if causal else (b,), **f32)
    return new_rows(q, d, q.dtype), q.new_empty((b, h, nw, d), **f32), mean, coef

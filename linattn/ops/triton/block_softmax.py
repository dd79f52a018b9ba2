"""Block-diagonal softmax attention (LLN §4.2's Diag part), the custom ops ``linattn::block_softmax`` and
``linattn::block_softmax_backward``: one program per block of one head, its (bs, bs) scores in registers.

Forward: P = softmax(q kᵀ / sqrt(D)) over the keys of the query's own block that it may see (not padded, before the
end, not later if causal), 0 on a row that sees none; out = P v, or 0.5 (average_with + P v) (LLN+Diag's average).
With a key padding mask the blocks are those of each row's real-first order (``real_tokens``): a program reads its
rows, and writes them, through the order, so that padding anywhere is not counted and nothing is gathered.
Backward, P recomputed: dP = g vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)) / sqrt(D), dq = dS k, dk = dSᵀ q, dv = Pᵀ g, all
times ``scale``, plus another part's gradients (LLN's, in LLN+Diag) where given, added in fp32 and stored once in the
inputs' dtype. q kᵀ and g vᵀ multiply half inputs, P v and Pᵀ g a product ≤ 1 with half values: tensor cores with
fp32 accumulation; dS is unbounded, so its products are ``wide_dot``'s (fp32, or tf32 as ``LAUNCH`` sets). A block's
backward is a program per BF features of dq and dk and BV columns of dv (``LAUNCH``: all of them at D <= 64, half at
128, each program forming P and dS again), so that at D = 128 it holds 64-column tiles on 4 warps, as at 64.
"""
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    HALF,
    TINY,
    block,
    block_rows,
    cdiv,
    emulate_half_dot,
    half_dot,
    in_layout,
    inputs_in_layout,
    launch,
    mask_bytes,
    new_grads,
    new_rows,
    op_grads,
    tile_at,
    wide_dot,
)
from .kernel_op import kernel_op


@triton.jit
def _probs(q_ptr, k_ptr, mask_ptr, order_ptr, BH, FAIRSEQ: tl.constexpr, blk, pid, H, N, D, SQK, BS, sm_scale,
           BB: tl.constexpr, BD: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, CAUSAL: tl.constexpr,
           HAS_MASK: tl.constexpr):
    """The block's rows (BB,), which are inside the sequence, q and k (BB, BD) (fp32 from half) and P (BB, BB).
    With a mask the block is one of the row's real-first order (``order``, (B,N) int32): its rows are read through
    the order, and a key is visible where the mask says it is real. q and k at head stride SQK (``common.tile_at``)."""
    d = tl.arange(0, BD)
    i, rows, ok, key_ok = block_rows(mask_ptr, blk, pid, H, N, BS, BB, False)
    if HAS_MASK:
        row0 = (pid // H) * N
        rows = tl.load(order_ptr + row0 + rows, mask=ok, other=0)
        key_ok = ok & (tl.load(mask_ptr + row0 + rows, mask=ok, other=1) == 0)
    inside = ok[:, None] & (d[None, :] < D)
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=inside, other=0.0)
    kk = tl.load(k_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=inside, other=0.0)
    visible = key_ok[None, :] & ok[:, None]
    if CAUSAL:
        visible = visible & (i[None, :] <= i[:, None])
    s = tl.where(visible, half_dot(qq, tl.trans(kk), HALF_TY, EMULATE) * sm_scale, float("-inf"))
    top = tl.max(s, 1)
    e = tl.exp(s - tl.where(top == float("-inf"), 0.0, top)[:, None])  # exp(-inf) = 0 on hidden keys
    p = e / tl.maximum(tl.sum(e, 1), TINY)[:, None]  # a row that sees no key: 0
    return rows, ok, qq.to(tl.float32), kk.to(tl.float32), p


@triton.jit
def _forward(q_ptr, k_ptr, v_ptr, mask_ptr, order_ptr, avg_ptr, out_ptr, BH, H, N, D, DV, SQK, SV, BS,
             sm_scale, BB: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HALF_TY: tl.constexpr,
             EMULATE: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, AVERAGE: tl.constexpr,
             FAIRSEQ: tl.constexpr):
    """One block of one head: out (BS, DV) = P v, or 0.5 (avg + P v); every tensor in fairseq's layout (FAIRSEQ; q,
    k, v at head strides SQK, SV) or contiguous (``common.tile_at``)."""
    blk = tl.program_id(0)
    pid = tl.program_id(1)
    rows, ok, _, _, p = _probs(q_ptr, k_ptr, mask_ptr, order_ptr, BH, FAIRSEQ, blk, pid, H, N, D, SQK, BS, sm_scale,
                               BB, BD, HALF_TY, EMULATE, CAUSAL, HAS_MASK)
    e = tl.arange(0, BDV)
    inside = ok[:, None] & (e[None, :] < DV)
    vv = tl.load(v_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), mask=inside, other=0.0)
    o = half_dot(p, vv, HALF_TY, EMULATE)
    if AVERAGE:
        o = 0.5 * (tl.load(avg_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=inside, other=0.0) + o)
    tl.store(out_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), o.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward(q_ptr, k_ptr, v_ptr, grad_ptr, mask_ptr, order_ptr, aq_ptr, ak_ptr, av_ptr, dq_ptr, dk_ptr, dv_ptr, BH,
              H, N, D, DV, SQK, SV, BS, sm_scale, scale, BB: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
              BF: tl.constexpr, BV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_MASK: tl.constexpr, ADD: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One block of one head, its program's BF features of dq, dk and BV columns of dv (program j of the third axis:
    features j*BF.., columns j*BV..; P and dP recomputed from all of them) of ``scale`` x block softmax, computed
    in fp32, plus (ADD) aq, ak, av, stored in the inputs' dtype; every tensor in fairseq's layout (FAIRSEQ; q, k,
    their gradients and addends at X = SQK, v's at SV: ``common.inputs_in_layout``) or contiguous; grad at DV."""
    blk = tl.program_id(0)
    pid = tl.program_id(1)
    rows, ok, qq, kk, p = _probs(q_ptr, k_ptr, mask_ptr, order_ptr, BH, FAIRSEQ, blk, pid, H, N, D, SQK, BS,
                                 sm_scale, BB, BD, HALF_TY, EMULATE, CAUSAL, HAS_MASK)
    f = tl.program_id(2) * BF + tl.arange(0, BF)
    c = tl.program_id(2) * BV + tl.arange(0, BV)
    e = tl.arange(0, BDV)
    inside = ok[:, None] & (e[None, :] < DV)
    vv = tl.load(v_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), mask=inside, other=0.0)
    gg = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=inside, other=0.0)
    dp = half_dot(gg, tl.trans(vv), HALF_TY, EMULATE)
    ds = p * (dp - tl.sum(dp * p, 1)[:, None]) * (sm_scale * scale)
    inside_d = ok[:, None] & (f[None, :] < D)
    at = tile_at(pid, rows, f, N, SQK, BH, FAIRSEQ)  # q, k, their gradients and addends: one layout
    if BF < BD:  # q and k at the program's features
        qq = tl.load(q_ptr + at, mask=inside_d, other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + at, mask=inside_d, other=0.0).to(tl.float32)
    inside = ok[:, None] & (c[None, :] < DV)
    at_v = tile_at(pid, rows, c, N, SV, BH, FAIRSEQ)  # dv and its addend
    if BV < BDV:  # the output gradient at the program's columns
        gg = tl.load(grad_ptr + tile_at(pid, rows, c, N, DV, BH, FAIRSEQ), mask=inside, other=0.0)
    dq = wide_dot(ds, kk, WIDE)
    dk = wide_dot(tl.trans(ds), qq, WIDE)
    dv = half_dot(tl.trans(p), gg, HALF_TY, EMULATE) * scale
    if ADD:
        dq += tl.load(aq_ptr + at, mask=inside_d, other=0.0).to(tl.float32)
        dk += tl.load(ak_ptr + at, mask=inside_d, other=0.0).to(tl.float32)
        dv += tl.load(av_ptr + at_v, mask=inside, other=0.0).to(tl.float32)
    tl.store(dq_ptr + at, dq.to(dq_ptr.dtype.element_ty), mask=inside_d)
    tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=inside_d)
    tl.store(dv_ptr + at_v, dv.to(dv_ptr.dtype.element_ty), mask=inside)


@kernel_op("block_softmax")
def block_softmax(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], order: Optional[Tensor], block_size: int,
                  causal: bool, average_with: Optional[Tensor]) -> Tensor:
    """q, k (B,H,N,D), v (B,H,N,Dv) half; mask (B,N) True = padded key and ``order`` (B,N) int32 its rows' real-first
    order (the blocks' rows), or both None; ``block_size`` rows a block (<= N); ``average_with`` (B,H,N,Dv) fp32 or
    None -> block softmax (B,H,N,Dv), or 0.5 (average_with + it), q's dtype, in q's layout (``common.new_rows``)."""
    b, h, n, d = q.shape
    dv = v.shape[-1]
    out = new_rows(q, dv, q.dtype)
    fairseq, sqk, sv, (q, k, v) = inputs_in_layout(q, k, v)
    mask_u8, order = _mask_and_order(mask, order, k)
    avg = out if average_with is None else in_layout(average_with, fairseq)
    _forward[(cdiv(n, block_size), b * h)](
        q, k, v, mask_u8, order, avg, out, b * h, h, n, d, dv, sqk, sv, block_size, 1 / math.sqrt(d),
        BB=block(block_size),
        BD=block(d), BDV=block(dv), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), CAUSAL=causal,
        HAS_MASK=mask is not None, FAIRSEQ=fairseq,
        AVERAGE=average_with is not None, **launch("block_softmax", d))
    return out


@torch.library.register_fake(block_softmax)
def _(q, k, v, mask, order, block_size, causal, average_with):
    return new_rows(q, v.shape[-1], q.dtype)


@kernel_op("block_softmax_backward")
def block_softmax_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, mask: Optional[Tensor],
                           order: Optional[Tensor], block_size: int, causal: bool, scale: float,
                           add_q: Optional[Tensor], add_k: Optional[Tensor],
                           add_v: Optional[Tensor], pack: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk (B,H,N,D), dv (B,H,N,Dv) of ``scale`` x block softmax, from dL/d(out) ``grad`` (q's dtype), plus
    add_q, add_k, add_v (another part's gradients, or all None) added in fp32; in q's dtype and the layouts of q, k,
    v, as ``common.op_grads`` (``pack``: ``common.new_grads``')."""
    b, h, n, d = q.shape
    dv_dim = v.shape[-1]
    dq, dk, dv, packed = new_grads(q, k, v, pack)
    fairseq, sqk, sv, (q, k, v, grad) = inputs_in_layout(q, k, v, grad.to(q.dtype), pack=pack)
    mask_u8, order = _mask_and_order(mask, order, k)
    add = add_q is not None
    addends = [_strided_as(a, out) for a, out in zip((add_q, add_k, add_v), (dq, dk, dv))] if add else [dq, dk, dv]
    cols = launch("block_softmax_backward", d, dv_dim)
    _backward[(cdiv(n, block_size), b * h, max(cdiv(d, cols["BF"]), cdiv(dv_dim, cols["BV"])))](
        q, k, v, grad, mask_u8, order, *addends, dq, dk, dv, b * h, h, n, d, dv_dim, sqk, sv, block_size,
        1 / math.sqrt(d), float(scale), BB=block(block_size), BD=block(d), BDV=block(dv_dim), HALF_TY=HALF[q.dtype],
        EMULATE=emulate_half_dot(q.dtype), CAUSAL=causal, HAS_MASK=mask is not None, ADD=add, FAIRSEQ=fairseq,
        **cols)
    return op_grads(dq, dk, dv, packed)


@torch.library.register_fake(block_softmax_backward)
def _(q, k, v, grad, mask, order, block_size, causal, scale, add_q, add_k, add_v, pack):
    return op_grads(*new_grads(q, k, v, pack))


def _mask_and_order(mask: Optional[Tensor], order: Optional[Tensor], stand_in: Tensor) -> Tuple[Tensor, Tensor]:
    """The mask's bytes (``common.mask_bytes``) and the order, contiguous, or ``stand_in`` for both without a mask
    (never read)."""
    if mask is None:
        return stand_in, stand_in
    if order is None:
        raise ValueError("block_softmax: a key padding mask needs its real-first order (real_tokens.real_first_order)")
    return mask_bytes(mask, stand_in), order.contiguous()


def _strided_as(addend: Tensor, out: Tensor) -> Tensor:
    """``addend`` with the strides of ``out`` (the kernel reads both at the same offsets): itself, or a copy."""
    if addend.stride() == out.stride():
        return addend
    return torch.empty_like(out, dtype=addend.dtype).copy_(addend)

"""The backward of non-causal LLN (LLN eq. 8-9), the custom op ``linattn::lln_noncausal_backward``: the parallel
implementation's backward (``lln/parallel._noncausal_backward``) in two kernels and one sum.

With go = scale [grad, -grad·out] / den (out as the forward stored it, in q's dtype): ``_state_grad``, grid
(B*H, cdiv(N, SPLIT_ROWS)), sums the partial dL/d[S, z] = phi_q^T go over SPLIT_ROWS queries of one head per program
(as (scale / z) p^T [grad, -grad·out], p = phi_q * z / den in [0, 1] and grad half: tensor cores in q's half dtype),
and one ``sum`` over the split axis adds them (deterministic, no atomics): one program per head would walk all N
queries alone, a tenth of an H100's 132 SMs at the training shapes (B*H = 12 to 24, N up to 32K). ``_rows_grad``,
grid (B*H, cdiv(max(N, S), ROWS)), gives per block of rows dq = (go [S, z]^T) phi_q alpha,
dk = ([v, 1] dL/d[S, z]^T) phi_k beta and dv = phi_k dL/dS. go and the states are unbounded: these products are
``wide_dot``'s (fp32, or tf32 as ``LAUNCH`` sets; in half operands, normalised, they spill at D = 128). ROWS and
SPLIT_ROWS are the forward's, read at call time.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import lln_noncausal as forward
from .common import (
    HALF,
    TINY,
    block,
    cdiv,
    emulate_half_dot,
    half_dot,
    inputs_in_layout,
    launch,
    load_state,
    mask_bytes,
    new_grads,
    op_grads,
    tile_at,
    wide_dot,
)
from .kernel_op import kernel_op


@triton.jit
def _query_terms(q_ptr, grad_ptr, out_ptr, BH, FAIRSEQ: tl.constexpr, alpha, m, den_ptr, pid, rows, N, D, DV,
                 SQK, BD: tl.constexpr, BDV: tl.constexpr):
    """phi_q (rows, BD) (0 outside), grad (rows, BDV) in fp32 (its half values), grad·out and 1 / den (rows,) for a
    block of rows, out as the forward stored it (q at head stride SQK): go = scale [grad, -grad·out] / den."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    ok = rows < N
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=ok[:, None] & (d[None, :] < D),
                 other=0.0).to(tl.float32)
    a = tl.where(d[None, :] < D, qq * alpha + m[None, :], float("-inf"))
    fq = tl.where(ok[:, None], tl.exp(a - tl.max(a, 1)[:, None]), 0.0)
    den = tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)  # clamped to >= TINY by the forward
    re = ok[:, None] & (e[None, :] < DV)
    out = tl.load(out_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
    gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
    return fq, gr, tl.sum(gr * out, 1), 1.0 / den


@triton.jit
def _state_grad(q_ptr, grad_ptr, out_ptr, alpha_ptr, m_ptr, s_ptr, den_ptr, part_ptr, BH, scale, N,
                SPLIT, D, DV, SQK, BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HALF_TY: tl.constexpr,
                EMULATE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One split of one head: part (D, DV+1) = its SPLIT queries' share of dL/d[S, z] = sum of phi_q^T go, as
    (scale / z) sum_i p_i^T [grad_i, -grad_i·out_i] with p = phi_q * z / den (the forward's ``_readout``)."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    alpha = tl.load(alpha_ptr + pid)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    z = tl.load(s_ptr + pid * D * (DV + 1) + d * (DV + 1) + DV, mask=d < D, other=0.0)
    dsv = tl.zeros((BD, BDV), tl.float32)
    dsz = tl.zeros((BD,), tl.float32)
    first = tl.program_id(1) * SPLIT
    end = tl.minimum(first + SPLIT, N)
    for start in range(first, end, BLOCK):
        fq, gr, t, rden = _query_terms(q_ptr, grad_ptr, out_ptr, BH, FAIRSEQ, alpha, m, den_ptr, pid,
                                       start + tl.arange(0, BLOCK), N, D, DV, SQK, BD, BDV)  # SPLIT: BLOCKs
        p = fq * z[None, :] * rden[:, None]
        dsv += half_dot(tl.trans(p), gr, HALF_TY, EMULATE)  # half operands: p in [0, 1], grad as given (half)
        dsz -= tl.sum(p * t[:, None], 0)
    rz = scale / tl.maximum(z, TINY)  # z >= 1 where a key is visible (else p = 0)
    at = part_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * D * (DV + 1)  # part (B, H, splits, D, DV+1)
    tl.store(at + d[:, None] * (DV + 1) + e[None, :], dsv * rz[:, None], mask=(d[:, None] < D) & (e[None, :] < DV))
    tl.store(at + d * (DV + 1) + DV, dsz * rz, mask=d < D)


@triton.jit
def _rows_grad(q_ptr, k_ptr, v_ptr, grad_ptr, out_ptr, alpha_ptr, beta_ptr, m_ptr, mask_ptr, s_ptr, den_ptr, ds_ptr,
               dq_ptr, dk_ptr, dv_ptr, BH, scale, H, N, S, D, DV, SQK, SV,
               BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
               FAIRSEQ: tl.constexpr):
    """One block of rows of one head: dq of its queries, dk and dv of its keys (computed in fp32, stored in
    the inputs' dtype; every tensor of rows in fairseq's layout (FAIRSEQ; q, k, dq, dk at X = SQK, v and dv at SV:
    ``common.inputs_in_layout``) or contiguous)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    sv, sz = load_state(s_ptr, pid * D * (DV + 1), D, DV, BD, BDV)
    alpha = tl.load(alpha_ptr + pid)
    fq, gr, t, rden = _query_terms(q_ptr, grad_ptr, out_ptr, BH, FAIRSEQ, alpha, m, den_ptr, pid, rows,
                                   N, D, DV, SQK, BD, BDV)
    go = gr * (scale * rden)[:, None]  # unbounded (den >= 1, but scale and grad as they come): wide products
    goz = -t * (scale * rden)
    dq = (wide_dot(go, tl.trans(sv), WIDE) + goz[:, None] * sz[None, :]) * fq * alpha
    tl.store(dq_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), dq.to(dq_ptr.dtype.element_ty),
             mask=(rows[:, None] < N) & (d[None, :] < D))
    ok = rows < S
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + (pid // H) * S + rows, mask=ok, other=1) == 0)
    live = ok[:, None] & (d[None, :] < D)
    beta = tl.load(beta_ptr + pid)
    kk = tl.load(k_ptr + tile_at(pid, rows, d, S, SQK, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    fk = tl.exp(tl.where(live, kk * beta - m[None, :], float("-inf")))  # padded keys: exp(-inf) = 0
    dsv, dsz = load_state(ds_ptr, pid * D * (DV + 1), D, DV, BD, BDV)
    at = tile_at(pid, rows, e, S, SV, BH, FAIRSEQ)  # v and dv
    vv = tl.load(v_ptr + at, mask=ok[:, None] & (e[None, :] < DV), other=0.0).to(tl.float32)
    dk = (wide_dot(vv, tl.trans(dsv), WIDE) + dsz[None, :]) * fk * beta
    inside = (rows[:, None] < S) & (d[None, :] < D)
    tl.store(dk_ptr + tile_at(pid, rows, d, S, SQK, BH, FAIRSEQ), dk.to(dk_ptr.dtype.element_ty), mask=inside)
    tl.store(dv_ptr + at, wide_dot(fk, dsv, WIDE).to(dv_ptr.dtype.element_ty),
             mask=(rows[:, None] < S) & (e[None, :] < DV))


@kernel_op("lln_noncausal_backward")
def lln_noncausal_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, alpha: Tensor, beta: Tensor,
                           m: Tensor, s: Tensor, den: Tensor, mask: Optional[Tensor],
                           scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq (B,H,N,D), dk (B,H,S,D), dv (B,H,S,Dv) in the inputs' dtype of ``scale`` x LLN from dL/d(out) ``grad``
    and the output and state of ``lln_noncausal`` (out in q's dtype, m, s, den), as ``common.op_grads``."""
    dq, dk, dv, packed = new_grads(q, k, v)
    b, h, n, d = q.shape
    length, dv_dim = v.shape[2], v.shape[3]
    fairseq, sqk, sv, (q, k, v, grad, out) = inputs_in_layout(q, k, v, grad, out)
    m, s, den = m.contiguous(), s.contiguous(), den.contiguous()
    rows, split_rows = forward.ROWS, forward.SPLIT_ROWS
    assert split_rows % rows == 0, (split_rows, rows)
    splits = max(1, cdiv(n, split_rows))
    part = s.new_empty((b, h, splits, d, dv_dim + 1))  # each split's dL/d[S, z], summed below: no atomics
    _state_grad[(b * h, splits)](q, grad, out, alpha, m, s, den, part, b * h, scale, n, split_rows, d, dv_dim, sqk,
                                 BLOCK=rows, FAIRSEQ=fairseq, BD=block(d), BDV=block(dv_dim), HALF_TY=HALF[q.dtype],
                                 EMULATE=emulate_half_dot(q.dtype), **launch("lln_noncausal_state_grad", d))
    ds = part.sum(2)
    mask_u8 = mask_bytes(mask, k)
    _rows_grad[(b * h, cdiv(max(n, length), rows))](
        q, k, v, grad, out, alpha, beta, m, mask_u8, s, den, ds, dq, dk, dv, b * h, scale, h, n, length, d, dv_dim,
        sqk, sv, BLOCK=rows, FAIRSEQ=fairseq,
        BD=block(d), BDV=block(dv_dim), HAS_MASK=mask is not None, **launch("lln_noncausal_rows_grad", d))
    return op_grads(dq, dk, dv, packed)


@torch.library.register_fake(lln_noncausal_backward)
def _(q, k, v, grad, out, alpha, beta, m, s, den, mask, scale):
    return op_grads(*new_grads(q, k, v))

"""The backward of non-causal LLN (LLN eq. 8-9), the custom op ``linattn::lln_noncausal_backward``: the parallel
implementation's backward (``lln/parallel._noncausal_backward``) in two kernels and one sum.

With go = scale [grad, -grad·out] / den (out as the forward stored it, in q's dtype): ``_state_grad``, grid
(B*H, cdiv(N, SPLIT_ROWS)), sums the partial dL/d[S, z] = phi_q^T go over SPLIT_ROWS queries of one head per program
(as (scale / z) p^T [grad, -grad·out], p = phi_q * z / den in [0, 1] and grad half: tensor cores in q's half dtype),
and one ``sum`` over the split axis adds them (deterministic, no atomics): one program per head would walk all N
queries alone, a tenth of an H100's 132 SMs at the training shapes (B*H = 12 to 24, N up to 32K). ``_rows_grad``,
grid (B*H, cdiv(max(N, S), ROWS), parts), gives per block of rows dq = (go [S, z]^T) phi_q alpha,
dk = ([v, 1] dL/d[S, z]^T) phi_k beta and dv = phi_k dL/dS, each program one part: BF features of dq, or BF
features of dk and BV columns of dv (``LAUNCH``; the whole of D and Dv at D <= 64): apart, the queries' and the
keys' tiles are never live at once. go and the states are unbounded: these products are ``wide_dot``'s (fp32, or
tf32 as ``LAUNCH`` sets; in half operands, normalised, they spilled at D = 128). ROWS and SPLIT_ROWS are the
forward's, read at call time.
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
    top = tl.max(a, 1)
    fq = tl.where(ok[:, None], tl.exp(a - top[:, None]), 0.0)
    den = tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)  # clamped to >= TINY by the forward
    re = ok[:, None] & (e[None, :] < DV)
    out = tl.load(out_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
    gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
    return fq, gr, tl.sum(gr * out, 1), 1.0 / den, top


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
        fq, gr, t, rden, _ = _query_terms(q_ptr, grad_ptr, out_ptr, BH, FAIRSEQ, alpha, m, den_ptr, pid,
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
               BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
               HAS_MASK: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One block of rows of one head, one part of its gradients (computed in fp32, stored in the inputs' dtype):
    program j < cdiv(D, BF) of the third axis, dq's features j*BF.. of its queries; program cdiv(D, BF) + j, dk's
    features j*BF.. and dv's columns j*BV.. of its keys. Every tensor of rows in fairseq's layout (FAIRSEQ; q, k, dq,
    dk at X = SQK, v and dv at SV: ``common.inputs_in_layout``) or contiguous."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    part = tl.program_id(2)
    query_parts = tl.cdiv(D, BF)
    if part < query_parts:
        _query_grads(q_ptr, grad_ptr, out_ptr, alpha_ptr, m_ptr, s_ptr, den_ptr, dq_ptr, BH, scale, N, D, DV, SQK,
                     pid, rows, part * BF + tl.arange(0, BF), BD, BDV, WIDE, FAIRSEQ)
    else:
        _key_grads(k_ptr, v_ptr, beta_ptr, m_ptr, mask_ptr, ds_ptr, dk_ptr, dv_ptr, BH, H, S, D, DV, SQK, SV, pid, rows,
                   (part - query_parts) * BF + tl.arange(0, BF), (part - query_parts) * BV + tl.arange(0, BV), BD,
                   BDV, HAS_MASK, WIDE, FAIRSEQ)


@triton.jit
def _query_grads(q_ptr, grad_ptr, out_ptr, alpha_ptr, m_ptr, s_ptr, den_ptr, dq_ptr, BH, scale, N, D, DV, SQK, pid,
                 rows, f, BD: tl.constexpr, BDV: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """dq = (go [S, z]^T) phi_q alpha at features f (len(f) <= BD) of the queries ``rows`` of head ``pid``."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    alpha = tl.load(alpha_ptr + pid)
    fq, gr, t, rden, top = _query_terms(q_ptr, grad_ptr, out_ptr, BH, FAIRSEQ, alpha, m, den_ptr, pid, rows,
                                        N, D, DV, SQK, BD, BDV)
    if f.shape[0] < BD:  # phi_q at the program's features, shifted by the row's maximum over all of them
        mf = tl.load(m_ptr + pid * D + f, mask=f < D, other=0.0)
        qq = tl.load(q_ptr + tile_at(pid, rows, f, N, SQK, BH, FAIRSEQ), mask=(rows[:, None] < N) & (f[None, :] < D),
                     other=0.0).to(tl.float32)
        fq = tl.exp(qq * alpha + mf[None, :] - top[:, None])
    sv, sz = forward.state_tile(s_ptr, pid * D * (DV + 1), f, e, D, DV)
    go = gr * (scale * rden)[:, None]  # unbounded (den >= 1, but scale and grad as they come): wide products
    goz = -t * (scale * rden)
    dq = (wide_dot(go, tl.trans(sv), WIDE) + goz[:, None] * sz[None, :]) * fq * alpha
    tl.store(dq_ptr + tile_at(pid, rows, f, N, SQK, BH, FAIRSEQ), dq.to(dq_ptr.dtype.element_ty),
             mask=(rows[:, None] < N) & (f[None, :] < D))


@triton.jit
def _key_grads(k_ptr, v_ptr, beta_ptr, m_ptr, mask_ptr, ds_ptr, dk_ptr, dv_ptr, BH, H, S, D, DV, SQK, SV, pid, rows,
               f, c, BD: tl.constexpr, BDV: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
               FAIRSEQ: tl.constexpr):
    """dk = ([v, 1] dL/d[S, z]^T) phi_k beta at features f and dv = phi_k dL/dS at value columns c (len(f) <= BD,
    len(c) <= BDV) of the keys ``rows`` of head ``pid``."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    ok = rows < S
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + (pid // H) * S + rows, mask=ok, other=1) == 0)
    beta = tl.load(beta_ptr + pid)
    fk = _key_features(k_ptr, beta, m_ptr, pid, rows, d, ok, S, D, SQK, BH, FAIRSEQ)
    dsv, _ = forward.state_tile(ds_ptr, pid * D * (DV + 1), d, c, D, DV)
    tl.store(dv_ptr + tile_at(pid, rows, c, S, SV, BH, FAIRSEQ), wide_dot(fk, dsv, WIDE).to(dv_ptr.dtype.element_ty),
             mask=(rows[:, None] < S) & (c[None, :] < DV))
    if f.shape[0] < BD:
        fk = _key_features(k_ptr, beta, m_ptr, pid, rows, f, ok, S, D, SQK, BH, FAIRSEQ)
    dsv, dsz = forward.state_tile(ds_ptr, pid * D * (DV + 1), f, e, D, DV)
    vv = tl.load(v_ptr + tile_at(pid, rows, e, S, SV, BH, FAIRSEQ), mask=ok[:, None] & (e[None, :] < DV),
                 other=0.0).to(tl.float32)
    dk = (wide_dot(vv, tl.trans(dsv), WIDE) + dsz[None, :]) * fk * beta
    tl.store(dk_ptr + tile_at(pid, rows, f, S, SQK, BH, FAIRSEQ), dk.to(dk_ptr.dtype.element_ty),
             mask=(rows[:, None] < S) & (f[None, :] < D))


@triton.jit
def _key_features(k_ptr, beta, m_ptr, pid, rows, f, ok, S, D, SQK, BH, FAIRSEQ: tl.constexpr):
    """phi_k = exp(beta k - m) (rows, features f) of the keys ``rows`` of head ``pid``, 0 where not ``ok`` (padded
    or outside) or outside D."""
    live = ok[:, None] & (f[None, :] < D)
    m = tl.load(m_ptr + pid * D + f, mask=f < D, other=0.0)
    kk = tl.load(k_ptr + tile_at(pid, rows, f, S, SQK, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    return tl.exp(tl.where(live, kk * beta - m[None, :], float("-inf")))  # padded keys: exp(-inf) = 0


@kernel_op("lln_noncausal_backward")
def lln_noncausal_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, alpha: Tensor, beta: Tensor,
                           m: Tensor, s: Tensor, den: Tensor, mask: Optional[Tensor],
                           scale: float, pack: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq (B,H,N,D), dk (B,H,S,D), dv (B,H,S,Dv) in the inputs' dtype of ``scale`` x LLN from dL/d(out) ``grad``
    and the output and state of ``lln_noncausal`` (out in q's dtype, m, s, den), as ``common.op_grads`` (``pack``:
    ``common.new_grads``')."""
    dq, dk, dv, packed = new_grads(q, k, v, pack)
    b, h, n, d = q.shape
    length, dv_dim = v.shape[2], v.shape[3]
    fairseq, sqk, sv, (q, k, v, grad, out) = inputs_in_layout(q, k, v, grad, out, pack=pack)
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
    cols = launch("lln_noncausal_rows_grad", d, dv_dim)
    query_parts = cdiv(d, cols["BF"])  # the programs of dq's features, then those of dk's features and dv's columns
    parts = query_parts + max(query_parts, cdiv(dv_dim, cols["BV"]))
    _rows_grad[(b * h, cdiv(max(n, length), rows), parts)](
        q, k, v, grad, out, alpha, beta, m, mask_u8, s, den, ds, dq, dk, dv, b * h, scale, h, n, length, d, dv_dim,
        sqk, sv, BLOCK=rows, FAIRSEQ=fairseq,
        BD=block(d), BDV=block(dv_dim), HAS_MASK=mask is not None, **cols)
    return op_grads(dq, dk, dv, packed)


@torch.library.register_fake(lln_noncausal_backward)
def _(q, k, v, grad, out, alpha, beta, m, s, den, mask, scale, pack):
    return op_grads(*new_grads(q, k, v, pack))

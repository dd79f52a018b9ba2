"""The backward of non-causal LLN (LLN eq. 8-9), the custom op ``linattn::lln_noncausal_backward``: the parallel
implementation's backward (``lln/parallel._noncausal_backward``) in two kernels.

With go = scale [grad, -grad·out] / den (out rebuilt from phi_q and [S, z]): ``_state_grad`` sums
dL/d[S, z] = phi_q^T go over the queries of each head; ``_rows_grad`` gives, per block of rows,
dq = (go [S, z]^T) phi_q alpha, dk = ([v, 1] dL/d[S, z]^T) phi_k beta and dv = phi_k dL/dS. go and the states are
unbounded: their products are read in fp32 ("ieee").
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import block
from .lln_noncausal import ROWS


@triton.jit
def _query_terms(q_ptr, grad_ptr, alpha, m, sv, den_ptr, scale, pid, rows, N, D, DV, BD: tl.constexpr,
                 BDV: tl.constexpr):
    """phi_q (rows, D) and go = scale [grad, -grad·out] / den as (value columns, ones column) for a block of rows."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    ok = rows < N
    qq = tl.load(q_ptr + pid * N * D + rows[:, None] * D + d[None, :], mask=ok[:, None] & (d[None, :] < D),
                 other=0.0).to(tl.float32)
    a = tl.where(d[None, :] < D, qq * alpha + m[None, :], float("-inf"))
    fq = tl.where(ok[:, None], tl.exp(a - tl.max(a, 1)[:, None]), 0.0)
    den = tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)  # clamped to >= TINY by the forward
    out = tl.dot(fq, sv, input_precision="ieee") / den[:, None]
    gr = tl.load(grad_ptr + pid * N * DV + rows[:, None] * DV + e[None, :], mask=ok[:, None] & (e[None, :] < DV),
                 other=0.0).to(tl.float32)
    return fq, gr * (scale / den)[:, None], -tl.sum(gr * out, 1) * (scale / den)


@triton.jit
def _state(s_ptr, pid, D, DV, BD: tl.constexpr, BDV: tl.constexpr):
    """[S, z] (D, DV+1) of one head as (S, z)."""
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    base = s_ptr + pid * D * (DV + 1) + d[:, None] * (DV + 1)
    sv = tl.load(base + e[None, :], mask=(d[:, None] < D) & (e[None, :] < DV), other=0.0)
    return sv, tl.load(s_ptr + pid * D * (DV + 1) + d * (DV + 1) + DV, mask=d < D, other=0.0)


@triton.jit
def _state_grad(q_ptr, grad_ptr, alpha_ptr, m_ptr, s_ptr, den_ptr, ds_ptr, scale, N, D, DV, BLOCK: tl.constexpr,
                BD: tl.constexpr, BDV: tl.constexpr):
    """One head: ds (D, DV+1) = dL/d[S, z] = sum over its queries of phi_q^T go."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    alpha = tl.load(alpha_ptr + pid)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    sv, _ = _state(s_ptr, pid, D, DV, BD, BDV)
    dsv = tl.zeros((BD, BDV), tl.float32)
    dsz = tl.zeros((BD,), tl.float32)
    start = 0
    while start < N:  # not ``for ... in range(N)``: see ``common.py``
        fq, go, goz = _query_terms(q_ptr, grad_ptr, alpha, m, sv, den_ptr, scale, pid, start + tl.arange(0, BLOCK), N,
                                   D, DV, BD, BDV)
        dsv += tl.dot(tl.trans(fq), go, input_precision="ieee")
        dsz += tl.sum(fq * goz[:, None], 0)
        start += BLOCK
    base = ds_ptr + pid * D * (DV + 1) + d[:, None] * (DV + 1)
    tl.store(base + e[None, :], dsv, mask=(d[:, None] < D) & (e[None, :] < DV))
    tl.store(ds_ptr + pid * D * (DV + 1) + d * (DV + 1) + DV, dsz, mask=d < D)


@triton.jit
def _rows_grad(q_ptr, k_ptr, v_ptr, grad_ptr, alpha_ptr, beta_ptr, m_ptr, mask_ptr, s_ptr, den_ptr, ds_ptr, dq_ptr,
               dk_ptr, dv_ptr, scale, H, N, S, D, DV, BLOCK: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               HAS_MASK: tl.constexpr):
    """One block of rows of one head: dq of its queries, dk and dv of its keys (fp32)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    sv, sz = _state(s_ptr, pid, D, DV, BD, BDV)
    alpha = tl.load(alpha_ptr + pid)
    fq, go, goz = _query_terms(q_ptr, grad_ptr, alpha, m, sv, den_ptr, scale, pid, rows, N, D, DV, BD, BDV)
    dq = (tl.dot(go, tl.trans(sv), input_precision="ieee") + goz[:, None] * sz[None, :]) * fq * alpha
    tl.store(dq_ptr + pid * N * D + rows[:, None] * D + d[None, :], dq, mask=(rows[:, None] < N) & (d[None, :] < D))
    ok = rows < S
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + (pid // H) * S + rows, mask=ok, other=1) == 0)
    live = ok[:, None] & (d[None, :] < D)
    beta = tl.load(beta_ptr + pid)
    kk = tl.load(k_ptr + pid * S * D + rows[:, None] * D + d[None, :], mask=live, other=0.0).to(tl.float32)
    fk = tl.where(live, tl.exp(kk * beta - m[None, :]), 0.0)
    dsv, dsz = _state(ds_ptr, pid, D, DV, BD, BDV)
    at = rows[:, None] * DV + e[None, :]
    vv = tl.load(v_ptr + pid * S * DV + at, mask=ok[:, None] & (e[None, :] < DV), other=0.0).to(tl.float32)
    dk = (tl.dot(vv, tl.trans(dsv), input_precision="ieee") + dsz[None, :]) * fk * beta
    inside = (rows[:, None] < S) & (d[None, :] < D)
    tl.store(dk_ptr + pid * S * D + rows[:, None] * D + d[None, :], dk, mask=inside)
    tl.store(dv_ptr + pid * S * DV + at, tl.dot(fk, dsv, input_precision="ieee"),
             mask=(rows[:, None] < S) & (e[None, :] < DV))


@torch.library.custom_op("linattn::lln_noncausal_backward", mutates_args=())
def lln_noncausal_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, alpha: Tensor, beta: Tensor, m: Tensor,
                           s: Tensor, den: Tensor, mask: Optional[Tensor],
                           scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """dq (B,H,N,D), dk (B,H,S,D), dv (B,H,S,Dv) in fp32 of ``scale`` x LLN from dL/d(out) ``grad`` and the state
    of ``lln_noncausal`` (m, s, den)."""
    dq, dk, dv = _empty(q, k, v)
    b, h, n, d = q.shape
    length, dv_dim = v.shape[2], v.shape[3]
    q, k, v, grad, m, s, den = (t.contiguous() for t in (q, k, v, grad, m, s, den))
    ds = torch.empty_like(s)
    _state_grad[(b * h,)](q, grad, alpha, m, s, den, ds, scale, n, d, dv_dim, BLOCK=ROWS, BD=block(d),
                          BDV=block(dv_dim))
    mask_u8 = k if mask is None else mask.to(torch.uint8).contiguous()
    _rows_grad[(b * h, triton.cdiv(max(n, length), ROWS))](
        q, k, v, grad, alpha, beta, m, mask_u8, s, den, ds, dq, dk, dv, scale, h, n, length, d, dv_dim, BLOCK=ROWS,
        BD=block(d), BDV=block(dv_dim), HAS_MASK=mask is not None)
    return dq, dk, dv


@lln_noncausal_backward.register_fake
def _(q, k, v, grad, alpha, beta, m, s, den, mask, scale):
    return _empty(q, k, v)


def _empty(q: Tensor, k: Tensor, v: Tensor):
    return (q.new_empty(q.shape, dtype=torch.float32), k.new_empty(k.shape, dtype=torch.float32),
            v.new_empty(v.shape, dtype=torch.float32))

"""Causal LLN (LLN eq. 8-9) as a chunk kernel, the custom op ``linattn::lln_causal``.

One program per head walks its chunks of C rows in order. The shifts are the parallel implementation's
(``lln/parallel.py``, computed there and passed in): m_prev (the running per-feature key maximum over *earlier*
chunks), m_incl (over chunks <= c), a key's excess g_j >= 0 over m_prev and a query's running maximum rho_i of g.
Per chunk:
W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i) for j <= i (C×C in registers; later keys removed by selection, so no
output depends on a future token, also through rounding), out = (W [v, 1] + e^(-rho) phi_q [S_c, z_c]) divided by
its last column. The state [S, z] (D, Dv+1) stays in fp32 registers: it is written out before each chunk (the
backward reads S_c) and then S_(c+1) = e^(m_prev - m_incl) S_c + phi_k(m_incl)^T [v, 1]. phi_q, phi_k, e^(g - rho)
are <= 1 and W <= D: their products with v run on tensor cores in the input's half dtype, fp32 accumulation.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import HALF, TINY, block, emulate_half_dot, half_dot


@triton.jit
def _chunks(q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr, rho_ptr, lse_ptr, s_ptr,
            out_ptr, den_ptr, H, N, D, DV, NC, C, BC: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
            HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr):
    """One head: every chunk in order; stores out (N, DV), den (N,) and the states before each chunk (NC, D, DV+1)."""
    pid = tl.program_id(0)
    i = tl.arange(0, BC)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    dok = d < D
    eok = e < DV
    alpha = tl.load(alpha_ptr + pid)
    beta = tl.load(beta_ptr + pid)
    s = tl.zeros((BD, BDV), tl.float32)
    z = tl.zeros((BD,), tl.float32)
    c = 0
    while c < NC:  # not ``for ... in range(NC)``: see ``common.py``
        rows = c * C + i
        ok = (i < C) & (rows < N)
        key_ok = ok
        if HAS_MASK:
            key_ok = ok & (tl.load(mask_ptr + (pid // H) * N + rows, mask=ok, other=1) == 0)
        state = s_ptr + (pid * NC + c) * D * (DV + 1) + d[:, None] * (DV + 1)
        tl.store(state + e[None, :], s, mask=dok[:, None] & eok[None, :])
        tl.store(s_ptr + (pid * NC + c) * D * (DV + 1) + d * (DV + 1) + DV, z, mask=dok)
        mp = tl.load(mp_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        mi = tl.load(mi_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        g = tl.load(g_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        rho = tl.load(rho_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        lse = tl.load(lse_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        at = rows[:, None] * D + d[None, :]
        bk = tl.load(k_ptr + pid * N * D + at, mask=ok[:, None] & dok[None, :], other=0.0).to(tl.float32) * beta
        live = key_ok[:, None] & dok[None, :]
        fk = tl.where(live, tl.exp((bk - mp[None, :]) - g[:, None]), 0.0)
        qq = tl.load(q_ptr + pid * N * D + at, mask=ok[:, None] & dok[None, :], other=0.0).to(tl.float32)
        fq = tl.where(ok[:, None] & dok[None, :], tl.exp((mp[None, :] + qq * alpha) - lse[:, None]), 0.0)
        w = half_dot(fq, tl.trans(fk), HALF_TY, EMULATE) * tl.exp(tl.minimum(g[None, :] - rho[:, None], 0.0))
        w = tl.where(i[None, :] <= i[:, None], w, 0.0).to(HALF_TY).to(tl.float32)  # j <= i, by selection
        vv = tl.load(v_ptr + pid * N * DV + rows[:, None] * DV + e[None, :], mask=ok[:, None] & eok[None, :],
                     other=0.0)
        r = tl.exp(-rho)
        o = half_dot(w, vv, HALF_TY, EMULATE) + r[:, None] * tl.dot(fq, s, input_precision="ieee")
        den = tl.maximum(tl.sum(w, 1) + r * tl.sum(fq * z[None, :], 1), TINY)
        tl.store(out_ptr + pid * N * DV + rows[:, None] * DV + e[None, :],
                 (o / den[:, None]).to(out_ptr.dtype.element_ty), mask=ok[:, None] & eok[None, :])
        tl.store(den_ptr + pid * N + rows, den, mask=ok)
        fki = tl.where(live, tl.exp(bk - mi[None, :]), 0.0)  # phi_k referenced to m_incl: the next chunks' state
        decay = tl.exp(tl.minimum(mp - mi, 0.0))  # <= 1; S is 0 where m_prev had no key yet
        s = s * decay[:, None] + half_dot(tl.trans(fki), vv, HALF_TY, EMULATE)
        z = z * decay + tl.sum(fki, 0)
        c += 1


@torch.library.custom_op("linattn::lln_causal", mutates_args=())
def lln_causal(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, mask: Optional[Tensor], m_prev: Tensor,
               m_incl: Tensor, g: Tensor, rho: Tensor, lse: Tensor, averaged: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k (B,H,N,D), v (B,H,N,Dv) half; alpha, beta (B,H) fp32; mask (B,N) or None; the shifts m_prev, m_incl
    (B,H,D,nc), g, rho (B,H,nc,C), lse (B,H,nc,C,1) fp32 -> out (B,H,N,Dv) (q's dtype, fp32 if ``averaged``),
    the states before each chunk s (B,H,nc,D,Dv+1), den (B,H,N,1)."""
    out, s, den = _empty(q, v, g, averaged)
    b, h, n, d = q.shape
    nc, c = g.shape[2:]
    dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask_u8 = k if mask is None else mask.to(torch.uint8).contiguous()
    _chunks[(b * h,)](q, k, v, alpha, beta, mask_u8, m_prev.contiguous(), m_incl.contiguous(), g.contiguous(),
                      rho.contiguous(), lse.contiguous(), s, out, den, h, n, d, dv, nc, c, BC=block(c), BD=block(d),
                      BDV=block(dv), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype),
                      HAS_MASK=mask is not None)
    return out, s, den


@lln_causal.register_fake
def _(q, k, v, alpha, beta, mask, m_prev, m_incl, g, rho, lse, averaged):
    return _empty(q, v, g, averaged)


def _empty(q: Tensor, v: Tensor, g: Tensor, averaged: bool):
    b, h, n, d = q.shape
    dv = v.shape[-1]
    return (q.new_empty((b, h, n, dv), dtype=torch.float32 if averaged else q.dtype),
            q.new_empty((b, h, g.shape[2], d, dv + 1), dtype=torch.float32),
            q.new_empty((b, h, n, 1), dtype=torch.float32))

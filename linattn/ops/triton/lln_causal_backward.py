"""The backward of causal LLN (LLN eq. 8-9) as a chunk kernel, the custom op ``linattn::lln_causal_backward``: the
parallel implementation's backward (``lln/parallel._causal_backward``) with its prefix over chunks turned into a
reverse pass.

One program per head walks its chunks from the last. With go = scale [grad, -grad·out] / den and A_c = (phi_q
e^(-rho))^T go over chunk c, dL/dU_c = G_c = sum_{c' > c} e^(m_incl_c - m_prev_c') A_c' is carried in fp32
registers: G_(c-1) = A_c + e^(m_prev_c - m_incl_c) G_c. Inside a chunk the C×C products are formed in registers,
later keys removed by selection. go is unbounded, so every product with it (and with the states) is read in fp32
("ieee"); the bounded ones (phi_q phi_k^T, phi_k <= 1 with v) run on tensor cores in the half dtype.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import HALF, block, emulate_half_dot, half_dot


@triton.jit
def _chunks_backward(q_ptr, k_ptr, v_ptr, grad_ptr, out_ptr, den_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr,
                     mi_ptr, g_ptr, rho_ptr, lse_ptr, s_ptr, dq_ptr, dk_ptr, dv_ptr, scale, H, N, D, DV, NC, C,
                     BC: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HALF_TY: tl.constexpr,
                     EMULATE: tl.constexpr, HAS_MASK: tl.constexpr):
    """One head: every chunk from the last; stores dq, dk (N, D) and dv (N, DV) in fp32."""
    pid = tl.program_id(0)
    i = tl.arange(0, BC)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    dok = d < D
    eok = e < DV
    alpha = tl.load(alpha_ptr + pid)
    beta = tl.load(beta_ptr + pid)
    gv = tl.zeros((BD, BDV), tl.float32)  # G_c: dL/dU_c, its value columns
    gz = tl.zeros((BD,), tl.float32)  # and its ones column
    c = NC - 1
    while c >= 0:  # not ``for ... in range``: see ``common.py``
        rows = c * C + i
        ok = (i < C) & (rows < N)
        key_ok = ok
        if HAS_MASK:
            key_ok = ok & (tl.load(mask_ptr + (pid // H) * N + rows, mask=ok, other=1) == 0)
        mp = tl.load(mp_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        mi = tl.load(mi_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        g = tl.load(g_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        rho = tl.load(rho_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        lse = tl.load(lse_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        at = rows[:, None] * D + d[None, :]
        rd = ok[:, None] & dok[None, :]
        re = ok[:, None] & eok[None, :]
        ate = rows[:, None] * DV + e[None, :]
        qq = tl.load(q_ptr + pid * N * D + at, mask=rd, other=0.0).to(tl.float32)
        fq = tl.where(rd, tl.exp((mp[None, :] + qq * alpha) - lse[:, None]), 0.0)
        bk = tl.load(k_ptr + pid * N * D + at, mask=rd, other=0.0).to(tl.float32) * beta
        live = key_ok[:, None] & dok[None, :]
        fk = tl.where(live, tl.exp((bk - mp[None, :]) - g[:, None]), 0.0)
        fki = tl.where(live, tl.exp(bk - mi[None, :]), 0.0)
        vv = tl.load(v_ptr + pid * N * DV + ate, mask=re, other=0.0)
        vf = vv.to(tl.float32)
        # go = scale [grad, -grad·out] / den (``parallel._scaled_output_grad``)
        den = tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)
        gr = tl.load(grad_ptr + pid * N * DV + ate, mask=re, other=0.0).to(tl.float32)
        ou = tl.load(out_ptr + pid * N * DV + ate, mask=re, other=0.0).to(tl.float32)
        go = gr * (scale / den)[:, None]
        goz = -tl.sum(gr * ou, 1) * (scale / den)
        r = tl.exp(-rho)
        # the queries' part through the state S_c
        state = s_ptr + (pid * NC + c) * D * (DV + 1) + d[:, None] * (DV + 1)
        sv = tl.load(state + e[None, :], mask=dok[:, None] & eok[None, :], other=0.0)
        sz = tl.load(s_ptr + (pid * NC + c) * D * (DV + 1) + d * (DV + 1) + DV, mask=dok, other=0.0)
        dfq = r[:, None] * (tl.dot(go, tl.trans(sv), input_precision="ieee") + goz[:, None] * sz[None, :])
        # inside the chunk: j <= i, by selection
        causal = i[None, :] <= i[:, None]
        ex = tl.exp(tl.minimum(g[None, :] - rho[:, None], 0.0))
        dqk = tl.where(causal, (tl.dot(go, tl.trans(vf), input_precision="ieee") + goz[:, None]) * ex, 0.0)
        dfq += tl.dot(dqk, fk, input_precision="ieee")
        w = tl.where(causal, half_dot(fq, tl.trans(fk), HALF_TY, EMULATE) * ex, 0.0)
        dv = tl.dot(tl.trans(w), go, input_precision="ieee") + tl.dot(fki, gv, input_precision="ieee")
        dbk = tl.dot(tl.trans(dqk), fq, input_precision="ieee") * fk + (
            tl.dot(vf, tl.trans(gv), input_precision="ieee") + gz[None, :]) * fki
        tl.store(dq_ptr + pid * N * D + at, dfq * fq * alpha, mask=rd)
        tl.store(dk_ptr + pid * N * D + at, dbk * beta, mask=rd)
        tl.store(dv_ptr + pid * N * DV + ate, dv, mask=re)
        # G_(c-1) = A_c + e^(m_prev_c - m_incl_c) G_c, A_c = (phi_q e^(-rho))^T go
        fqr = fq * r[:, None]
        decay = tl.exp(tl.minimum(mp - mi, 0.0))
        gv = gv * decay[:, None] + tl.dot(tl.trans(fqr), go, input_precision="ieee")
        gz = gz * decay + tl.sum(fqr * goz[:, None], 0)
        c -= 1


@torch.library.custom_op("linattn::lln_causal_backward", mutates_args=())
def lln_causal_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, den: Tensor, alpha: Tensor,
                        beta: Tensor, mask: Optional[Tensor], m_prev: Tensor, m_incl: Tensor, g: Tensor, rho: Tensor,
                        lse: Tensor, s: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk (B,H,N,D), dv (B,H,N,Dv) in fp32 of ``scale`` x causal LLN, from dL/d(out) ``grad`` and the state of
    ``lln_causal`` (out, den, s) and of its shifts (as ``lln_causal`` takes them)."""
    dq, dk, dv = _empty(q, v)
    b, h, n, d = q.shape
    nc, c = g.shape[2:]
    dv_dim = v.shape[-1]
    mask_u8 = k if mask is None else mask.to(torch.uint8).contiguous()
    _chunks_backward[(b * h,)](
        q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous(), out.contiguous(), den.contiguous(), alpha,
        beta, mask_u8, m_prev.contiguous(), m_incl.contiguous(), g.contiguous(), rho.contiguous(), lse.contiguous(),
        s.contiguous(), dq, dk, dv, scale, h, n, d, dv_dim, nc, c, BC=block(c), BD=block(d), BDV=block(dv_dim),
        HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), HAS_MASK=mask is not None)
    return dq, dk, dv


@lln_causal_backward.register_fake
def _(q, k, v, grad, out, den, alpha, beta, mask, m_prev, m_incl, g, rho, lse, s, scale):
    return _empty(q, v)


def _empty(q: Tensor, v: Tensor):
    return (q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape, dtype=torch.float32),
            v.new_empty(v.shape, dtype=torch.float32))

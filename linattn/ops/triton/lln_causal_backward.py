"""The backward of causal LLN (LLN eq. 8-9) as three chunk kernels, the custom op ``linattn::lln_causal_backward``:
the parallel implementation's backward (``lln/parallel._causal_backward``) with its prefix over chunks turned into a
reverse walk.

With go = scale [grad, -grad·out] / den and A_c = (phi_q e^(-rho))^T go over chunk c, dL/dU_c = G_c =
sum_{c' > c} e^(m_incl_c - m_prev_c') A_c' obeys G_(c-1) = A_c + e^(m_prev_c - m_incl_c) G_c.

- ``_grad_states``, grid (B*H x segments, D / BF, Dv / BV): G_c (fp32) of every chunk for a block of features, from
  the last chunk (the only walk over the chunks; feature blocks are independent), in segments of SPLIT chunks
  (``common.walk_grid``), launched twice as the forward's ``_states``: first (ENDS) every segment but the first from
  G = 0 at its last chunk, storing G before its first chunk and the product of its decays e^(m_prev - m_incl); then
  every segment from its carry, the later segments' ends composed from the last (G <- end + decays G), then its
  chunks, storing each G_c (go's ones column, -grad·out r, over every value column BV at a time). The ends' pass
  reads q, grad and out once more, where storing each segment's local G_c and composing them with their carry in
  ``_grads`` would add a state tile to that kernel's registers (178-251 a thread);
- ``_grads``, grid (chunks, B*H, D / BF): a chunk's dq and dk for a block of features, from the forward's state S_c
  (dq), G_c (dk) and the in-chunk dL/d(q_i·k_j) = (go vᵀ + go_z) e^(g_j - rho_i) for j <= i (LLN eq. 9's
  weights' gradient, C×C, formed in registers over every value column, BV at a time, later keys removed by
  selection);
- ``_value_grads``, grid (chunks, B*H, Dv / BV): a chunk's dv for a block of value columns, from the in-chunk weights
  (phi_q phi_k^T) e^(g_j - rho_i), j <= i (C×C, over every feature, BF at a time) and G_c.

dq and dk share the in-chunk gradient dL/d(q_i·k_j), dv the in-chunk weights: the two C×C tiles, which one kernel
held together with S_c, G_c and every (C, D) tile (255 registers a thread on 8 warps, spilling 104-136 bytes at D =
64 and 1.5 KiB at 128 on sm_90), are split between two kernels as flash-linear-attention splits its chunked
backward (dq, dk in one kernel, dv in another); neither needs the other's results (no sum across kernels, no fp32
scratch), and only G_c is read twice. ``_grads`` takes a block of BF = 16 features a program and ``_value_grads``
BV = 64 value columns (``LAUNCH``), each block forming its C×C tile again; at D = Dv = 128 (``LAUNCH_128``)
``_grads`` takes 32 features and steps over the value columns 32 at a time, forming its features' tiles after
them, and ``_value_grads`` steps over the features 32 at a time (and the walk takes BV = 64), so that every tile is
(C, 32), (C, 64) or C×C: on sm_90 none spills at D = 64 or 128, each on 4 warps at two blocks an SM (Triton 3.6
and 3.9; ``_grads`` in steps of 64 value columns at D = 128 spills 32-72 bytes).

go = r grad (r = scale / den) is unbounded, so its products with the features and states are ``wide_dot``'s (fp32,
or tf32 as ``LAUNCH`` sets); go vᵀ is r (grad vᵀ), grad and v both half: exact products on tensor cores, as are the
bounded ones (phi_q phi_k^T, phi_k <= 1 with v) in the half dtype.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    HALF,
    block,
    block_rows,
    cdiv,
    emulate_half_dot,
    half_dot,
    inputs_in_layout,
    launch,
    mask_bytes,
    new_grads,
    op_grads,
    tile_at,
    walk_grid,
    wide_dot,
)
from .kernel_op import kernel_op


@triton.jit
def _ones_grad(grad_ptr, out_ptr, BH, FAIRSEQ: tl.constexpr, pid, rows, ok, N, DV, BC: tl.constexpr,
               BDV: tl.constexpr, BV: tl.constexpr):
    """grad·out (C,) of a chunk's rows, over the DV columns BV at a time (a (C, BV) tile of each, not (C, DV)): go's
    ones column is -scale grad·out / den (``parallel._scaled_output_grad``)."""
    acc = tl.zeros((BC,), tl.float32)
    for j in range(0, BDV, BV):
        e = j + tl.arange(0, BV)
        re = ok[:, None] & (e[None, :] < DV)
        gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
        ou = tl.load(out_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
        acc += tl.sum(gr * ou, 1)
    return acc


@triton.jit
def _grad_states(q_ptr, grad_ptr, out_ptr, den_ptr, alpha_ptr, mp_ptr, mi_ptr, rho_ptr, lse_ptr, gs_ptr, ends_ptr, BH,
                 scale, N, D, DV, SQK, NC, C, SEG, BC: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
                 BDV: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr, ENDS: tl.constexpr):
    """One head, features BF*j .. BF*(j+1), value columns BV*l .. BV*(l+1), one segment of SEG chunks (program
    BH*segment + head). The walk: G at the segment's last chunk from the ends of the segments after it, then, from
    that chunk, stores G_c of every chunk of the segment into gs (NC, D, DV+1) (its ones column: the programs of
    l = 0). ENDS (segments 1, 2, ...: segment 0's no one reads): the segment walked from G = 0 at its last chunk, only
    its end stored into ``ends`` (segments - 1, D, DV+2): G before its first chunk and the product of its decays in
    the last column."""
    pid = tl.program_id(0) % BH
    seg = tl.program_id(0) // BH + ENDS
    d = tl.program_id(1) * BF + tl.arange(0, BF)
    e = tl.program_id(2) * BV + tl.arange(0, BV)
    dok = d < D
    eok = e < DV
    alpha = tl.load(alpha_ptr + pid)
    nends = (NC - 1) // SEG  # the segments whose ends are stored: all but the first
    first = seg * SEG
    last = tl.minimum(first + SEG, NC)
    gv = tl.zeros((BF, BV), tl.float32)  # G_c: dL/dU_c, its value columns
    gz = tl.zeros((BF,), tl.float32)  # and its ones column
    decays = tl.full((BF,), 1.0, tl.float32)  # ENDS: the product of the segment's decays
    if not ENDS:
        for t in range(0, nends - seg):  # the later segments' ends, from the last: G before each one's first chunk
            end = ends_ptr + ((pid * nends + nends - 1 - t) * D + d) * (DV + 2)
            carry = tl.load(end + DV + 1, mask=dok, other=1.0)
            gv = gv * carry[:, None] + tl.load(end[:, None] + e[None, :], mask=dok[:, None] & eok[None, :], other=0.0)
            gz = gz * carry + tl.load(end + DV, mask=dok, other=0.0)
    for t in range(0, last - first):  # a forward loop (pipelined) over the segment's chunks from the last
        c = last - 1 - t
        if not ENDS:
            state = gs_ptr + ((pid * NC + c) * D + d) * (DV + 1)
            tl.store(state[:, None] + e[None, :], gv, mask=dok[:, None] & eok[None, :])
            if tl.program_id(2) == 0:  # the ones column, once
                tl.store(state + DV, gz, mask=dok)
        i, rows, ok, _ = block_rows(q_ptr, c, pid, 1, N, C, BC, False)  # queries: no mask
        mp = tl.load(mp_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        mi = tl.load(mi_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
        rho = tl.load(rho_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        lse = tl.load(lse_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
        rd = ok[:, None] & dok[None, :]
        qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=rd, other=0.0).to(tl.float32)
        fqr = tl.where(rd, tl.exp((mp[None, :] + qq * alpha) - lse[:, None] - rho[:, None]), 0.0)  # phi_q e^(-rho)
        rs = scale / tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)  # go = scale [grad, -grad·out] / den
        goz = -_ones_grad(grad_ptr, out_ptr, BH, FAIRSEQ, pid, rows, ok, N, DV, BC, BDV, BV) * rs  # every column
        gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=ok[:, None] & eok[None, :],
                     other=0.0).to(tl.float32)  # this program's value columns
        go = gr * rs[:, None]
        # G_(c-1) = A_c + e^(m_prev_c - m_incl_c) G_c, A_c = (phi_q e^(-rho))^T go (LLN eq. 9's state, backward)
        decay = tl.exp(tl.minimum(mp - mi, 0.0))
        gv = gv * decay[:, None] + wide_dot(tl.trans(fqr), go, WIDE)
        gz = gz * decay + tl.sum(fqr * goz[:, None], 0)
        if ENDS:
            decays = decays * decay
    if ENDS:
        end = ends_ptr + ((pid * nends + seg - 1) * D + d) * (DV + 2)
        tl.store(end[:, None] + e[None, :], gv, mask=dok[:, None] & eok[None, :])
        if tl.program_id(2) == 0:
            tl.store(end + DV, gz, mask=dok)
            tl.store(end + DV + 1, decays, mask=dok)


@triton.jit
def _state_rows(ptr, at, d, e, D, DV):
    """Of a state [S, z] stored (D, DV+1) fp32 at ``ptr + at``: S's rows d, columns e; 0 outside (z, the last
    column: ``ptr + at + d * (DV + 1) + DV``)."""
    row = ptr + at + d * (DV + 1)
    return tl.load(row[:, None] + e[None, :], mask=(d[:, None] < D) & (e[None, :] < DV), other=0.0)


@triton.jit
def _chunk_features(q_ptr, k_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr, rho_ptr, lse_ptr, c, pid, d,
                    BH, H, N, D, SQK, NC, C, BC: tl.constexpr, HAS_MASK: tl.constexpr, FAIRSEQ: tl.constexpr):
    """What both gradient kernels form of chunk c of head pid for the features d: its rows (``block_rows``), q's
    and k's offsets, beta, the shifts m_incl (the features'), g and rho, phi_q (fq) and phi_k (fk) as the forward's
    ``_outputs`` (LLN eq. 8, shifted), beta k and which keys are live."""
    dok = d < D
    alpha = tl.load(alpha_ptr + pid)
    beta = tl.load(beta_ptr + pid)
    i, rows, ok, key_ok = block_rows(mask_ptr, c, pid, H, N, C, BC, HAS_MASK)
    mp = tl.load(mp_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
    mi = tl.load(mi_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
    g = tl.load(g_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
    rho = tl.load(rho_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
    lse = tl.load(lse_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
    at = tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ)  # q, k, dq, dk: one layout
    rd = ok[:, None] & dok[None, :]
    qq = tl.load(q_ptr + at, mask=rd, other=0.0).to(tl.float32)
    fq = tl.where(rd, tl.exp((mp[None, :] + qq * alpha) - lse[:, None]), 0.0)
    bk = tl.load(k_ptr + at, mask=rd, other=0.0).to(tl.float32) * beta
    live = key_ok[:, None] & dok[None, :]
    fk = tl.exp(tl.where(live, (bk - mp[None, :]) - g[:, None], float("-inf")))  # padded keys: exp(-inf) = 0
    return i, rows, ok, at, rd, alpha, beta, mi, g, rho, fq, fk, bk, live


@triton.jit
def _grads(q_ptr, k_ptr, v_ptr, grad_ptr, out_ptr, den_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr,
           rho_ptr, lse_ptr, s_ptr, gs_ptr, dq_ptr, dk_ptr, BH, scale, H, N,
           D, DV, SQK, SV, NC, C, BC: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
           HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
           FAIRSEQ: tl.constexpr):
    """One chunk of one head, features BF*j .. BF*(j+1): stores their dq and dk (C, BF), computed in fp32, in the
    inputs' dtype (q, k, dq, dk at X = SQK, v at SV: fairseq's layout (FAIRSEQ) or contiguous,
    ``common.inputs_in_layout``); both from the in-chunk product dL/d(q_i·k_j) (``dqk``, over every value column:
    each block of features forms it), which ``_value_grads`` does not need. The value columns are read BV at a
    time (grad, out, v (C, BV) and the states' (BF, BV)), their products with them summed over the blocks."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    d = tl.program_id(2) * BF + tl.arange(0, BF)
    _, rows, ok, _ = block_rows(mask_ptr, c, pid, H, N, C, BC, False)  # the rows of grad, out and v
    rs = scale / tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)  # go = scale [grad, -grad·out] / den
    state = (pid * NC + c) * D * (DV + 1)
    gvh = tl.zeros((BC, BC), tl.float32)  # grad vᵀ
    gos = tl.zeros((BC, BF), tl.float32)  # go S_cᵀ: the queries' part through the state
    vgs = tl.zeros((BC, BF), tl.float32)  # v G_cᵀ: the keys' part through the later chunks' queries
    gro = tl.zeros((BC,), tl.float32)  # grad·out
    for j in range(0, BDV, BV):
        e = j + tl.arange(0, BV)
        re = ok[:, None] & (e[None, :] < DV)
        gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
        ou = tl.load(out_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
        gro += tl.sum(gr * ou, 1)
        # v in its half dtype (fewer registers): exact as fp32
        vh = tl.load(v_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), mask=re, other=0.0)
        # go vᵀ = r (grad vᵀ): grad and v are half, so their products are exact on tensor cores
        gvh += half_dot(gr, tl.trans(vh), HALF_TY, EMULATE)
        sv = _state_rows(s_ptr, state, d, e, D, DV)  # S_c's rows of these features
        gos += wide_dot(gr * rs[:, None], tl.trans(sv), WIDE)
        gv = _state_rows(gs_ptr, state, d, e, D, DV)  # G_c's
        vgs += wide_dot(vh.to(tl.float32), tl.trans(gv), WIDE)
    goz = -gro * rs
    # the features' tiles after the value columns' products: fewer tiles live at once
    i, rows, ok, at, rd, alpha, beta, mi, g, rho, fq, fk, bk, live = _chunk_features(
        q_ptr, k_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr, rho_ptr, lse_ptr, c, pid, d, BH, H, N, D,
        SQK, NC, C, BC, HAS_MASK, FAIRSEQ)
    # inside the chunk: j <= i, by selection
    causal = i[None, :] <= i[:, None]
    ex = tl.exp(tl.minimum(g[None, :] - rho[:, None], 0.0))
    dqk = tl.where(causal, (gvh * rs[:, None] + goz[:, None]) * ex, 0.0)
    # each gradient stored once complete: fewer fp32 tiles live at once
    # dq: the queries' part through the state S_c, and inside the chunk
    sz = tl.load(s_ptr + state + d * (DV + 1) + DV, mask=d < D, other=0.0)  # S_c's ones column, z
    dfq = tl.exp(-rho)[:, None] * (gos + goz[:, None] * sz[None, :])
    dfq += wide_dot(dqk, fk, WIDE)
    tl.store(dq_ptr + at, (dfq * fq * alpha).to(dq_ptr.dtype.element_ty), mask=rd)
    # dk: the keys' part inside the chunk, and through the later chunks' queries, G_c
    dbk = wide_dot(tl.trans(dqk), fq, WIDE) * fk
    gz = tl.load(gs_ptr + state + d * (DV + 1) + DV, mask=d < D, other=0.0)  # G_c's
    fki = tl.exp(tl.where(live, bk - mi[None, :], float("-inf")))
    dbk += (vgs + gz[None, :]) * fki
    tl.store(dk_ptr + at, (dbk * beta).to(dk_ptr.dtype.element_ty), mask=rd)


@triton.jit
def _value_grads(q_ptr, k_ptr, grad_ptr, den_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr, rho_ptr,
                 lse_ptr, gs_ptr, dv_ptr, BH, scale, H, N, D, DV, SQK, SV, NC, C, BC: tl.constexpr,
                 BD: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
                 HAS_MASK: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One chunk of one head, value columns BV*l .. BV*(l+1): stores their dv (C, BV), computed in fp32, in v's
    dtype (at X = SV): the values' part inside the chunk (the in-chunk weights w, C×C, which each block of value
    columns forms) and through the later chunks' queries (G_c); reads no v and no output (go's value columns only).
    The features are read BF at a time (phi_q, phi_k (C, BF), G_c's rows (BF, BV)), their products summed over the
    blocks."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    e = BV * tl.program_id(2) + tl.arange(0, BV)
    i, rows, ok, key_ok = block_rows(mask_ptr, c, pid, H, N, C, BC, HAS_MASK)
    g = tl.load(g_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
    rho = tl.load(rho_ptr + (pid * NC + c) * C + i, mask=i < C, other=0.0)
    w = tl.zeros((BC, BC), tl.float32)  # phi_q phi_kᵀ
    later = tl.zeros((BC, BV), tl.float32)  # the values' part through the later chunks' queries
    for f in range(0, BD, BF):
        d = f + tl.arange(0, BF)
        _, _, _, _, _, _, _, mi, _, _, fq, fk, bk, live = _chunk_features(
            q_ptr, k_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, g_ptr, rho_ptr, lse_ptr, c, pid, d, BH, H,
            N, D, SQK, NC, C, BC, HAS_MASK, FAIRSEQ)
        w += half_dot(fq, tl.trans(fk), HALF_TY, EMULATE)
        gv = _state_rows(gs_ptr, (pid * NC + c) * D * (DV + 1), d, e, D, DV)  # G_c: its value columns (its ones
        # column: dk's only)
        fki = tl.exp(tl.where(live, bk - mi[None, :], float("-inf")))
        later += wide_dot(fki, gv, WIDE)
    re = ok[:, None] & (e[None, :] < DV)
    causal = i[:, None] >= i[None, :]  # key j <= query i
    ex = tl.exp(tl.minimum(g[None, :] - rho[:, None], 0.0))
    w = tl.where(causal, w * ex, 0.0)
    den = tl.load(den_ptr + pid * N + rows, mask=ok, other=1.0)
    gr = tl.load(grad_ptr + tile_at(pid, rows, e, N, DV, BH, FAIRSEQ), mask=re, other=0.0).to(tl.float32)
    go = gr * (scale / den)[:, None]  # go's value columns (``_ones_grad``)
    dv = wide_dot(tl.trans(w), go, WIDE) + later
    tl.store(dv_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), dv.to(dv_ptr.dtype.element_ty), mask=re)


@kernel_op("lln_causal_backward")
def lln_causal_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, den: Tensor, alpha: Tensor,
                        beta: Tensor, mask: Optional[Tensor], m_prev: Tensor, m_incl: Tensor, g: Tensor, rho: Tensor,
                        lse: Tensor, s: Tensor, scale: float, pack: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk (B,H,N,D), dv (B,H,N,Dv) in the inputs' dtype and layout (``common.op_grads``) of ``scale`` x causal
    LLN, from dL/d(out) ``grad`` and the state of ``lln_causal`` (out, den, s) and its shifts (as ``lln_causal``
    returns them); ``pack`` as ``common.new_grads``'."""
    dq, dk, dv, packed = new_grads(q, k, v, pack)
    b, h, n, d = q.shape
    nc, c = g.shape[2:]
    dv_dim = v.shape[-1]
    mask_u8 = mask_bytes(mask, k)
    grad = grad.to(q.dtype)  # autograd's gradient of the op's output (q's dtype): its products with v are exact
    fairseq, sqk, sv, (q, k, v, grad, out) = inputs_in_layout(q, k, v, grad, out, pack=pack)
    den, m_prev, m_incl, rho, lse = (t.contiguous() for t in (den, m_prev, m_incl, rho, lse))
    gs = s.new_empty(s.shape)  # G_c of every chunk (B,H,nc,D,Dv+1)
    ends, walk = walk_grid(b, h, n, d, dv_dim, c, backward=True)
    seg_ends = s.new_empty((b, h, ends.grid[0] // (b * h), d, dv_dim + 2))  # [G, its ones column, decays] before each
    for level in (ends, walk):
        _grad_states[level.grid](q, grad, out, den, alpha, m_prev, m_incl, rho, lse, gs, seg_ends, b * h, scale, n, d,
                                 dv_dim, sqk, nc, c, level.seg, BC=block(c), BDV=block(dv_dim), FAIRSEQ=fairseq,
                                 ENDS=level is ends, **level.settings)
    sizes = dict(BC=block(c), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), HAS_MASK=mask is not None,
                 FAIRSEQ=fairseq)
    g, s = g.contiguous(), s.contiguous()
    qk = launch("lln_causal_grads", d, dv_dim)  # dq, dk: a program a chunk, head and block of BF features
    _grads[(nc, b * h, cdiv(d, qk["BF"]))](
        q, k, v, grad, out, den, alpha, beta, mask_u8, m_prev, m_incl, g, rho, lse, s, gs, dq, dk, b * h, scale, h, n,
        d, dv_dim, sqk, sv, nc, c, BDV=block(dv_dim), **sizes, **qk)
    values = launch("lln_causal_value_grads", d, dv_dim)  # dv: a chunk, head and block of BV value columns
    _value_grads[(nc, b * h, cdiv(dv_dim, values["BV"]))](
        q, k, grad, den, alpha, beta, mask_u8, m_prev, m_incl, g, rho, lse, gs, dv, b * h, scale, h, n, d, dv_dim, sqk,
        sv, nc, c, BD=block(d), **sizes, **values)
    return op_grads(dq, dk, dv, packed)


@torch.library.register_fake(lln_causal_backward)
def _(q, k, v, grad, out, den, alpha, beta, mask, m_prev, m_incl, g, rho, lse, s, scale, pack):
    return op_grads(*new_grads(q, k, v, pack))

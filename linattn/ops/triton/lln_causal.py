"""Causal LLN (LLN eq. 8-9) as chunk kernels, the custom op ``linattn::lln_causal``.

The shifts are the parallel implementation's (``lln/parallel.py``): m_prev (the running per-feature key maximum
over *earlier* chunks), m_incl (over chunks <= c), a key's excess g_j >= 0 over m_prev, a query's running maximum
rho_i of g in its chunk, and the query's own shift lse_i = max_d (m_prev_d + alpha q_id); all from the half inputs
in the kernels (the running key maximum by ``_states`` as it walks the chunks).

- ``_states``, grid (B*H x segments, D / BF, Dv / BV): the state [S_c, z_c] (fp32) before every chunk c for a block
  of features, and their m_prev, m_incl; S_(c+1) = e^(m_prev - m_incl) S_c + phi_k(m_incl)^T [v, 1] (phi_k referenced
  to m_incl, <= 1: its product with v on tensor cores in the half dtype, fp32 accumulation). The walk over the
  chunks, a light one (a (BF, C) x (C, BV) product a step); feature and value blocks are independent, and the
  chunks are split into segments of SPLIT (``common.walk_grid``), so that a head is many programs, each a short
  walk: launched twice. First (ENDS) every segment but the last from a zero state and no key, storing only its end:
  [S, z] after its last chunk, referenced to its own key maximum, and that maximum. Then every segment from its
  carry: the earlier segments' ends composed in order (a step a segment: the running maximum over their maxima, each
  state shifted by e^(m_before - m_after) <= 1 to it), then its chunks as above, storing each chunk's state. Walking
  the chunks, it keeps the running key maximum too (the carried one, then over its chunks), which is the whole
  sequence's exactly (a maximum is exact in any order): no block-maximum kernel, cummax and copies before it (five
  launches and a read of k fewer). The ends' pass reads k and v once more; the alternative, each segment's local
  states stored and composed with their carry where ``_outputs`` reads them, would write the states a second time
  for the backward (which reads the composed ones) and add a state tile to ``_outputs``' registers.
- ``_outputs``, grid (chunks, B*H, Dv / BV): every chunk at once from its stored state (g, rho and lse stored for
  the backward): W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i) for j <= i (C×C in registers; later keys removed by
  selection, so no output depends on a future token, also through rounding), out = (W [v, 1] + e^(-rho) phi_q
  [S_c, z_c]) divided by its last column, for a block of BV value columns (each block forming W again). The
  features are read BF at a time, twice (their maxima g and lse, then the products summed over the blocks): at
  D = Dv = 128 (``LAUNCH_128``: BF = 32, BV = 64) a (C, 32) tile of q, k and a (32, 64) one of the state, on 4 warps
  at two blocks an SM, where the whole (C, 128) tiles and state took 8 warps and 128 KiB of shared memory, one block.

Only ``_states`` walks the chunks, split over feature and value blocks and segments of chunks; a walk of one program
per head would leave most of a GPU idle at the training shapes (B*H = 12 programs at 32K tokens a step, 48 with the
feature blocks, each walking 512 chunks of 64; in segments of 32, 720 and 768 programs of at most 32 and 47 steps;
docs/design.md §1.3.1).
"""
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
    inputs_in_layout,
    launch,
    mask_bytes,
    new_rows,
    tile_at,
    walk_grid,
    wide_dot,
)
from .kernel_op import kernel_op


@triton.jit
def _states(k_ptr, v_ptr, beta_ptr, mask_ptr, mp_ptr, mi_ptr, s_ptr, ends_ptr, BH, H, N, D, DV, SQK, SV, NC, C, SEG,
            BC: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
            HAS_MASK: tl.constexpr, FAIRSEQ: tl.constexpr, ENDS: tl.constexpr):
    """One head, features BF*j .. BF*(j+1), value columns BV*l .. BV*(l+1), one segment of SEG chunks (program
    BH*segment + head). The walk: the state at the segment's start from the ends of the segments before it, then,
    chunk by chunk, stores the state before each chunk into s (NC, D, DV+1) and, the programs of l = 0, its z column
    and the shifts m_prev, m_incl (D, NC): the running maximum of beta k over the unpadded keys of the chunks before c
    and up to c, 0 before any key (and where it is not finite, as ``nan_to_num``). ENDS: the segment walked from a
    zero state and no key, only its end stored into ``ends`` (segments, D, DV+2): [S, z] after its last chunk,
    referenced to its own key maximum, and that maximum (-inf: no key) in the last column."""
    pid = tl.program_id(0) % BH
    seg = tl.program_id(0) // BH
    d = tl.program_id(1) * BF + tl.arange(0, BF)
    e = tl.program_id(2) * BV + tl.arange(0, BV)
    dok = d < D
    eok = e < DV
    beta = tl.load(beta_ptr + pid)
    nends = (NC - 1) // SEG  # the segments whose ends are stored: all but the last
    s = tl.zeros((BF, BV), tl.float32)
    z = tl.zeros((BF,), tl.float32)
    top = tl.full((BF,), float("-inf"), tl.float32)  # the running maximum, -inf before any key
    mi = tl.zeros((BF,), tl.float32)
    if not ENDS:
        for t in range(0, seg):  # the earlier segments' ends, each referenced to its own maximum, carried in
            end = ends_ptr + ((pid * nends + t) * D + d) * (DV + 2)
            seg_top = tl.load(end + DV + 1, mask=dok, other=float("-inf"))
            top = tl.maximum(top, seg_top)
            ref = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
            # LLN eq. 9's state shifted from each reference to the running maximum: e^(m_before - m_after) <= 1
            old = tl.exp(tl.minimum(mi - ref, 0.0))
            new = tl.exp(tl.minimum(tl.where((seg_top > float("-inf")) & (seg_top < float("inf")), seg_top, 0.0)
                                    - ref, 0.0))
            s = s * old[:, None] + tl.load(end[:, None] + e[None, :], mask=dok[:, None] & eok[None, :],
                                           other=0.0) * new[:, None]
            z = z * old + tl.load(end + DV, mask=dok, other=0.0) * new
            mi = ref
    for c in range(seg * SEG, tl.minimum(seg * SEG + SEG, NC)):
        if not ENDS:
            state = s_ptr + ((pid * NC + c) * D + d) * (DV + 1)
            tl.store(state[:, None] + e[None, :], s, mask=dok[:, None] & eok[None, :])
            if tl.program_id(2) == 0:  # the ones column, once
                tl.store(state + DV, z, mask=dok)
        _, rows, ok, key_ok = block_rows(mask_ptr, c, pid, H, N, C, BC, HAS_MASK)
        bk = tl.load(k_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=ok[:, None] & dok[None, :],
                     other=0.0).to(tl.float32) * beta
        live = key_ok[:, None] & dok[None, :]
        top = tl.maximum(top, tl.max(tl.where(live, bk, float("-inf")), 0))
        mp = mi
        mi = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
        if tl.program_id(2) == 0:
            tl.store(mp_ptr + (pid * D + d) * NC + c, mp, mask=dok & (not ENDS))  # ENDS: no store
            tl.store(mi_ptr + (pid * D + d) * NC + c, mi, mask=dok & (not ENDS))
        fki = tl.exp(tl.where(live, bk - mi[None, :], float("-inf")))  # phi_k to m_incl
        vv = tl.load(v_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), mask=ok[:, None] & eok[None, :], other=0.0)
        decay = tl.exp(tl.minimum(mp - mi, 0.0))  # <= 1; S is 0 where m_prev had no key yet
        s = s * decay[:, None] + half_dot(tl.trans(fki), vv, HALF_TY, EMULATE)
        z = z * decay + tl.sum(fki, 0)
    if ENDS:
        end = ends_ptr + ((pid * nends + seg) * D + d) * (DV + 2)
        tl.store(end[:, None] + e[None, :], s, mask=dok[:, None] & eok[None, :])
        if tl.program_id(2) == 0:
            tl.store(end + DV, z, mask=dok)
            tl.store(end + DV + 1, top, mask=dok)


@triton.jit
def _outputs(q_ptr, k_ptr, v_ptr, alpha_ptr, beta_ptr, mask_ptr, mp_ptr, g_ptr, rho_ptr, lse_ptr, s_ptr, out_ptr,
             half_ptr, den_ptr, BH, H, N, D, DV, SQK, SV, NC, C, BC: tl.constexpr, BD: tl.constexpr,
             BF: tl.constexpr, BV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
             HAS_MASK: tl.constexpr, WIDE: tl.constexpr, FAIRSEQ: tl.constexpr, AVERAGED: tl.constexpr):
    """One chunk of one head, value columns BV*l .. BV*(l+1): stores their out (C, BV) and, the programs of l = 0,
    den (C,) (LLN eq. 9 with the state before the chunk) and the shifts g, rho, lse (C,); AVERAGED: out in fp32 and,
    at ``half_ptr``, rounded to the half dtype too. q, k, v (head strides SQK, SV) and out in fairseq's layout
    (FAIRSEQ) or contiguous (``common.tile_at``). The features are read BF at a time, twice: their maxima (the
    shifts), then phi_q, phi_k (C, BF) and the state's rows (BF, BV), their products summed over the blocks."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    e = tl.program_id(2) * BV + tl.arange(0, BV)
    eok = e < DV
    alpha = tl.load(alpha_ptr + pid)
    beta = tl.load(beta_ptr + pid)
    i, rows, ok, key_ok = block_rows(mask_ptr, c, pid, H, N, C, BC, HAS_MASK)
    g = tl.zeros((BC,), tl.float32)  # a key's excess, 0 if padded
    lse = tl.full((BC,), float("-inf"), tl.float32)  # the query's own shift
    for f in range(0, BD, BF):
        d = f + tl.arange(0, BF)
        dok = d < D
        mp, bk, qq = _chunk_rows(q_ptr, k_ptr, mp_ptr, pid, c, rows, ok, d, beta, N, D, SQK, NC, BH, FAIRSEQ)
        g = tl.maximum(g, tl.max(tl.where(key_ok[:, None] & dok[None, :], bk - mp[None, :], float("-inf")), 1))
        lse = tl.maximum(lse, tl.max(tl.where(dok[None, :], mp[None, :] + qq * alpha, float("-inf")), 1))
    rho = tl.max(tl.where(i[None, :] <= i[:, None], g[None, :], 0.0), 1)  # the largest excess a query sees
    shift = (pid * NC + c) * C + i
    first = i < tl.where(tl.program_id(2) == 0, C, 0)  # the programs of l = 0 store the shifts and den
    tl.store(g_ptr + shift, g, mask=first)
    tl.store(rho_ptr + shift, rho, mask=first)
    tl.store(lse_ptr + shift, lse, mask=first)
    w = tl.zeros((BC, BC), tl.float32)  # phi_q phi_kᵀ
    fqs = tl.zeros((BC, BV), tl.float32)  # phi_q S_c
    fqz = tl.zeros((BC,), tl.float32)  # phi_q z_c
    for f in range(0, BD, BF):
        d = f + tl.arange(0, BF)
        dok = d < D
        mp, bk, qq = _chunk_rows(q_ptr, k_ptr, mp_ptr, pid, c, rows, ok, d, beta, N, D, SQK, NC, BH, FAIRSEQ)
        live = key_ok[:, None] & dok[None, :]
        fk = tl.exp(tl.where(live, (bk - mp[None, :]) - g[:, None], float("-inf")))  # padded keys: exp(-inf) = 0
        fq = tl.where(ok[:, None] & dok[None, :], tl.exp(mp[None, :] + qq * alpha - lse[:, None]), 0.0)
        w += half_dot(fq, tl.trans(fk), HALF_TY, EMULATE)
        state = s_ptr + ((pid * NC + c) * D + d) * (DV + 1)
        fqs += wide_dot(fq, tl.load(state[:, None] + e[None, :], mask=dok[:, None] & eok[None, :], other=0.0), WIDE)
        fqz += tl.sum(fq * tl.load(state + DV, mask=dok, other=0.0)[None, :], 1)
    w = w * tl.exp(tl.minimum(g[None, :] - rho[:, None], 0.0))
    w = tl.where(i[None, :] <= i[:, None], w, 0.0).to(HALF_TY).to(tl.float32)  # j <= i, by selection
    vv = tl.load(v_ptr + tile_at(pid, rows, e, N, SV, BH, FAIRSEQ), mask=ok[:, None] & eok[None, :], other=0.0)
    r = tl.exp(-rho)
    o = half_dot(w, vv, HALF_TY, EMULATE) + r[:, None] * fqs
    den = tl.maximum(tl.sum(w, 1) + r * fqz, TINY)
    o = o / den[:, None]
    at = tile_at(pid, rows, e, N, DV, BH, FAIRSEQ)
    tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=ok[:, None] & eok[None, :])
    if AVERAGED:
        tl.store(half_ptr + at, o.to(HALF_TY), mask=ok[:, None] & eok[None, :])
    tl.store(den_ptr + pid * N + rows, den, mask=ok & first)


@triton.jit
def _chunk_rows(q_ptr, k_ptr, mp_ptr, pid, c, rows, ok, d, beta, N, D, SQK, NC, BH, FAIRSEQ: tl.constexpr):
    """Of chunk c of head pid, the features d: m_prev (BF,), beta k and q (C, BF) in fp32, 0 outside."""
    dok = d < D
    mp = tl.load(mp_ptr + (pid * D + d) * NC + c, mask=dok, other=0.0)
    bk = tl.load(k_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=ok[:, None] & dok[None, :],
                 other=0.0).to(tl.float32) * beta
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=ok[:, None] & dok[None, :],
                 other=0.0).to(tl.float32)
    return mp, bk, qq


@kernel_op("lln_causal")
def lln_causal(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, mask: Optional[Tensor], chunk: int,
               averaged: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k (B,H,N,D), v (B,H,N,Dv) half; alpha, beta (B,H) fp32; mask (B,N) or None; ``chunk`` rows a chunk (<= N)
    -> out (B,H,N,Dv) (q's dtype, fp32 if ``averaged``), out in q's dtype if ``averaged`` (else empty), the states
    before each chunk s (B,H,nc,D,Dv+1), den (B,H,N,1) and the shifts m_prev, m_incl (B,H,D,nc), g, rho, lse
    (B,H,nc,C), fp32."""
    out, half, s, den, m_prev, m_incl, g, rho, lse = _empty(q, v, chunk, averaged)
    b, h, n, d = q.shape
    nc = g.shape[2]
    dv = v.shape[-1]
    fairseq, sqk, sv, (q, k, v) = inputs_in_layout(q, k, v)
    mask_u8 = mask_bytes(mask, k)
    sizes = dict(BC=block(chunk), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), HAS_MASK=mask is not None,
                 FAIRSEQ=fairseq)
    ends, walk = walk_grid(b, h, n, d, dv, chunk)
    seg_ends = s.new_empty((b, h, ends.grid[0] // (b * h), d, dv + 2))  # [S, z, key maximum] after each segment
    for level in (ends, walk):
        _states[level.grid](k, v, beta, mask_u8, m_prev, m_incl, s, seg_ends, b * h, h, n, d, dv, sqk, sv, nc, chunk,
                            level.seg, ENDS=level is ends, **sizes, **level.settings)
    outputs = launch("lln_causal_outputs", d, dv)  # a program a chunk, head and block of BV value columns
    _outputs[(nc, b * h, cdiv(dv, outputs["BV"]))](
        q, k, v, alpha, beta, mask_u8, m_prev, g, rho, lse, s, out, half, den, b * h, h, n, d, dv, sqk, sv, nc, chunk,
        BD=block(d), AVERAGED=averaged, **sizes, **outputs)
    return out, half, s, den, m_prev, m_incl, g, rho, lse


@torch.library.register_fake(lln_causal)
def _(q, k, v, alpha, beta, mask, chunk, averaged):
    return _empty(q, v, chunk, averaged)


def _empty(q: Tensor, v: Tensor, chunk: int, averaged: bool):
    b, h, n, d = q.shape
    dv = v.shape[-1]
    nc = -(-n // chunk)
    f32 = dict(dtype=torch.float32)
    out = new_rows(q, dv, torch.float32 if averaged else q.dtype)  # averaged: fp32, read by LLN+Diag's block kernel
    half = new_rows(q, dv, q.dtype) if averaged else q.new_empty(0)  # averaged: what the backward keeps
    return (out, half, q.new_empty((b, h, nc, d, dv + 1), **f32), q.new_empty((b, h, n, 1), **f32),
            q.new_empty((b, h, d, nc), **f32), q.new_empty((b, h, d, nc), **f32),
            *(q.new_empty((b, h, nc, chunk), **f32) for _ in range(3)))

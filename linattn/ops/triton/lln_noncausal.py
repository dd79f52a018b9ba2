"""Non-causal LLN (LLN eq. 8-9) in two kernels and one sum, as the custom op ``linattn::lln_noncausal``.

``_state``, grid (B*H, cdiv(S, SPLIT_ROWS)): each program sums the partial [S, z] = sum_j phi_k(k_j) [v_j, 1] of
SPLIT_ROWS keys of one head, phi_k = exp(beta k_j - m) <= 1 (m: the per-feature key maximum, which each program takes
over the splits' maxima from ``lln_key_max.py``: no reduction launched between them), S on tensor cores from
half phi_k and v, fp32 accumulation; one ``sum`` over the split axis then gives [S, z] (deterministic, no atomics).
One program per head would walk all S keys alone: at the training shapes (B*H = 12 to 24, S up to 32K) that is a
tenth of an H100's 132 SMs; splitting the keys fills them, and the launches stay two kernels and one sum at any S.
``_readout``, grid (B*H, cdiv(N, ROWS), cdiv(Dv, BV)): per block of queries and BV value columns (``LAUNCH``), phi_q
= exp(alpha q + m - max_d(alpha q + m)) <= 1 and out = p S' (LLN eq. 8), the product's operands bounded so that it
runs on tensor cores in q's half dtype: the probabilities p = phi_q * z / (phi_q z) in [0, 1] (each row sums to 1)
and the state's rows S' = S / z, each a weighted mean of the values (|S'| <= max |v|); z >= 1 where a key is visible
(its maximal key's feature is 1). As out = mu + p (S' - mu) with mu = S'_0 (p's rows sum to 1), the rounding of S' -
mu (|.| <= 2 max |v|) scales with the values' spread, not their offset (the backward's dq and dk cancel against the
saved output).
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
    cdiv,
    emulate_half_dot,
    half_dot,
    inputs_in_layout,
    launch,
    mask_bytes,
    new_rows,
    tile_at,
)
from .kernel_op import kernel_op
from .lln_key_max import key_block_max

# Both read at call time, here and by the backward (lln_noncausal_backward.py); SPLIT_ROWS a multiple of ROWS.
ROWS = 64  # keys per step of ``_state``, queries per program of ``_readout``
SPLIT_ROWS = 1024  # keys per program of ``_state``, queries per program of the backward's ``_state_grad``


@triton.jit
def _state(k_ptr, v_ptr, beta_ptr, top_ptr, m_ptr, mask_ptr, part_ptr, BH, H, S, SPLIT, D, DV, SQK, SV,
           BLOCK: tl.constexpr,
           BD: tl.constexpr, BDV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr, HAS_MASK: tl.constexpr,
           FAIRSEQ: tl.constexpr):
    """One split of one head: part (D, DV+1) = [S, z] over its SPLIT keys (LLN eq. 9), padded keys excluded (k, v at
    head strides SQK, SV: ``common.tile_at``), phi_k shifted by m (D,), the maximum over the splits' key maxima top
    (D, splits), 0 where no key (as ``nan_to_num``): stored by the first split's program for the readout."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    e = tl.arange(0, BDV)
    r = tl.arange(0, BLOCK)
    beta = tl.load(beta_ptr + pid)
    splits = tl.num_programs(1)
    m = tl.full((BD,), float("-inf"), tl.float32)
    for j in range(0, splits):
        m = tl.maximum(m, tl.load(top_ptr + (pid * D + d) * splits + j, mask=d < D, other=float("-inf")))
    m = tl.where((m > float("-inf")) & (m < float("inf")), m, 0.0)
    if tl.program_id(1) == 0:
        tl.store(m_ptr + pid * D + d, m, mask=d < D)
    s = tl.zeros((BD, BDV), tl.float32)
    z = tl.zeros((BD,), tl.float32)
    first = tl.program_id(1) * SPLIT
    end = tl.minimum(first + SPLIT, S)
    for start in range(first, end, BLOCK):
        rows = start + r
        ok = rows < end
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + (pid // H) * S + rows, mask=ok, other=1) == 0)
        kk = tl.load(k_ptr + tile_at(pid, rows, d, S, SQK, BH, FAIRSEQ), mask=ok[:, None] & (d[None, :] < D),
                     other=0.0).to(tl.float32)
        fk = tl.exp(tl.where(ok[:, None] & (d[None, :] < D), kk * beta - m[None, :], float("-inf")))  # padded: 0
        vv = tl.load(v_ptr + tile_at(pid, rows, e, S, SV, BH, FAIRSEQ), mask=ok[:, None] & (e[None, :] < DV),
                     other=0.0)
        s += half_dot(tl.trans(fk), vv, HALF_TY, EMULATE)
        z += tl.sum(fk, 0)
    at = part_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * D * (DV + 1)  # part (B, H, splits, D, DV+1)
    tl.store(at + d[:, None] * (DV + 1) + e[None, :], s, mask=(d[:, None] < D) & (e[None, :] < DV))
    tl.store(at + d * (DV + 1) + DV, z, mask=d < D)


@triton.jit
def _readout(q_ptr, alpha_ptr, m_ptr, s_ptr, out_ptr, half_ptr, den_ptr, BH, N, D, DV, SQK, BLOCK: tl.constexpr,
             BD: tl.constexpr, BV: tl.constexpr, HALF_TY: tl.constexpr, EMULATE: tl.constexpr,
             FAIRSEQ: tl.constexpr, AVERAGED: tl.constexpr):
    """One block of queries of one head, BV of its value columns: out = phi_q S / den = mu + p (S / z - mu) with
    den = max(phi_q z, TINY) (stored by the first block of columns), p = phi_q * z / den (BLOCK, BD) and mu (BV,)
    ``_values_centre``'s; AVERAGED: out in fp32 and, at ``half_ptr``, rounded to q's half dtype too."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    e = tl.program_id(2) * BV + tl.arange(0, BV)
    alpha = tl.load(alpha_ptr + pid)
    m = tl.load(m_ptr + pid * D + d, mask=d < D, other=0.0)
    ok = rows < N
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQK, BH, FAIRSEQ), mask=ok[:, None] & (d[None, :] < D),
                 other=0.0).to(tl.float32)
    a = tl.where(d[None, :] < D, qq * alpha + m[None, :], float("-inf"))  # the query absorbs the keys' shift
    fq = tl.exp(a - tl.max(a, 1)[:, None])
    s, z = state_tile(s_ptr, pid * D * (DV + 1), d, e, D, DV)
    den = tl.maximum(tl.sum(fq * z[None, :], 1), TINY)
    p = fq * z[None, :] * (1.0 / den)[:, None]
    mu = _values_centre(s_ptr, pid * D * (DV + 1), e, DV)  # out = mu + p (S / z - mu): p's row sums to 1
    # half operands: p in [0, 1] (a row sums to 1), S / z - mu (S / z, mu weighted means of v: |.| <= 2 max |v|)
    o = mu[None, :] + half_dot(p, s * (1.0 / tl.maximum(z, TINY))[:, None] - mu[None, :], HALF_TY, EMULATE)
    at = tile_at(pid, rows, e, N, DV, BH, FAIRSEQ)
    tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (e[None, :] < DV))
    if AVERAGED:
        tl.store(half_ptr + at, o.to(q_ptr.dtype.element_ty), mask=ok[:, None] & (e[None, :] < DV))
    if tl.program_id(2) == 0:
        tl.store(den_ptr + pid * N + rows, den, mask=ok)


@triton.jit
def state_tile(ptr, at, d, e, D, DV):
    """Of a state [S, z] stored (D, DV+1) fp32 at ``ptr + at``: S's rows d and columns e (len(d), len(e)) and z's
    rows d, 0 outside."""
    row = ptr + at + d * (DV + 1)
    return (tl.load(row[:, None] + e[None, :], mask=(d[:, None] < D) & (e[None, :] < DV), other=0.0),
            tl.load(row + DV, mask=d < D, other=0.0))


@triton.jit
def _values_centre(s_ptr, at, e, DV):
    """Columns e of the first feature's row of the state [S, z] (D, DV+1) at ``s_ptr + at``, S_0 / z_0 (len(e),): a
    weighted mean of the values (0 where no key), the centre of ``_readout``'s operand S / z - mu."""
    return tl.load(s_ptr + at + e, mask=e < DV, other=0.0) / tl.maximum(tl.load(s_ptr + at + DV), TINY)


@kernel_op("lln_noncausal")
def lln_noncausal(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, mask: Optional[Tensor],
                  averaged: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) half; alpha, beta (B,H) fp32; mask (B,S) or None -> out (B,H,N,Dv)
    (q's dtype, fp32 if ``averaged``), out in q's dtype if ``averaged`` (else empty), s = [S, z] (B,H,D,Dv+1), den
    (B,H,N,1) and the per-feature key maximum m (B,H,1,D) (0 where no key), fp32."""
    out, half, s, den, m = _empty(q, v, averaged)
    b, h, n, d = q.shape
    dv = v.shape[-1]
    fairseq, sqk, sv, (q, k, v) = inputs_in_layout(q, k, v)
    mask_u8 = mask_bytes(mask, k)
    length = k.shape[2]
    assert SPLIT_ROWS % ROWS == 0, (SPLIT_ROWS, ROWS)
    top = key_block_max(k, beta, mask_u8, mask is not None, SPLIT_ROWS)  # each split's, -inf where no key
    splits = max(1, cdiv(length, SPLIT_ROWS))
    part = s.new_empty((b, h, splits, d, dv + 1))  # each split's [S, z], summed below: deterministic, no atomics
    _state[(b * h, splits)](k, v, beta, top, m, mask_u8, part, b * h, h, length, SPLIT_ROWS, d, dv, sqk, sv, BLOCK=ROWS,
                            FAIRSEQ=fairseq,
                            BD=block(d), BDV=block(dv), HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype),
                            HAS_MASK=mask is not None, **launch("lln_noncausal_state", d))
    torch.sum(part, 2, out=s)
    readout = launch("lln_noncausal_readout", d, dv)
    _readout[(b * h, cdiv(n, ROWS), cdiv(dv, readout["BV"]))](
        q, alpha, m, s, out, half, den, b * h, n, d, dv, sqk, BLOCK=ROWS, FAIRSEQ=fairseq, BD=block(d),
        HALF_TY=HALF[q.dtype], EMULATE=emulate_half_dot(q.dtype), AVERAGED=averaged, **readout)
    return out, half, s, den, m


@torch.library.register_fake(lln_noncausal)
def _(q, k, v, alpha, beta, mask, averaged):
    return _empty(q, v, averaged)


def _empty(q: Tensor, v: Tensor, averaged: bool):
    b, h, n, d = q.shape
    dv = v.shape[-1]
    out = new_rows(q, dv, torch.float32 if averaged else q.dtype)  # averaged: fp32, read by LLN+Diag's block kernel
    half = new_rows(q, dv, q.dtype) if averaged else q.new_empty(0)  # averaged: what the backward keeps
    f32 = dict(dtype=torch.float32)
    return (out, half, q.new_empty((b, h, d, dv + 1), **f32), q.new_empty((b, h, n, 1), **f32),
            q.new_empty((b, h, 1, d), **f32))

"""LLN's fast CPU implementation: passes over rows of working size (non-causal) and groups of chunks (causal).

``forward`` and ``backward`` take ``LLNInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in the compute dtype; the
output and the gradients are written pass by pass into buffers allocated once (LLN+Diag then adds its block
softmax into the same ones).
"""
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import working_set
from .features import _TINY, _finite_or_zero
from .inputs import LLNInputs
from .scan import linear_scan_


class _NoncausalState(NamedTuple):
    """What the non-causal backward needs: the key shift m (B,H,1,D), S = [sum phi_k v^T, sum phi_k] (B,H,D,Dv+1)
    and the denominators (B,H,N,1)."""
    m: Tensor
    s: Tensor
    den: Tensor


class _CausalState(NamedTuple):
    """What the causal backward needs: the states S_c before each chunk (B,H,nc+1,D,Dv+1), the chunk shifts
    (``_chunk_shifts``: m_incl, m_prev, decay (B,H,nc,D)) and the denominators (B,H,N,1)."""
    s: Tensor
    m_incl: Tensor
    m_prev: Tensor
    decay: Tensor
    den: Tensor


class _OutputGrad(NamedTuple):
    """Where the backward starts: dL/d(out) ``grad`` (B,H,N,Dv) of ``scale`` * LLN, and LLN's output ``out``
    (None: rebuilt from the state)."""
    grad: Tensor
    out: Optional[Tensor]
    scale: float


class _Grads(NamedTuple):
    """dq, dk, dv, written pass by pass."""
    dq: Tensor
    dk: Tensor
    dv: Tensor


def forward(x: LLNInputs, *, averaged: bool = False) -> Tuple[Tensor, tuple]:
    """LLN (B,H,N,Dv) in the compute dtype, and what ``backward`` needs: (out, *state), out None if ``averaged``
    (the caller averages another part into the output in place, as LLN+Diag: the backward rebuilds it)."""
    out = x.q.new_empty(*x.q.shape[:3], x.v.shape[-1])
    state = _causal_forward(x, out) if x.causal else _noncausal_forward(x, out)
    return out, (None if averaged else out, *state)


def backward(x: LLNInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0) -> _Grads:
    """dq, dk, dv (compute dtype) of ``scale`` * LLN, from ``forward``'s ``saved`` and dL/d(out) (B,H,N,Dv)."""
    out, *state = saved
    grads = _Grads(torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(x.v))
    if x.causal:
        _causal_backward(x, _CausalState(*state), _OutputGrad(grad, out, scale), grads)
    else:
        _noncausal_backward(x, _NoncausalState(*state), _OutputGrad(grad, out, scale), grads)
    return grads


def _output_grad(grad: Tensor, out: Tensor, den: Tensor, buf: Optional[Tensor] = None) -> Tensor:
    """dL/d[numerator, denominator] (B,H,R,Dv+1) from dL/d(out), out = numerator / den; into ``buf`` if given."""
    buf = grad.new_empty(*grad.shape[:-1], grad.shape[-1] + 1) if buf is None else buf
    gn = torch.div(grad, den, out=buf[..., :-1])
    torch.linalg.vecdot(gn, out, out=buf[..., -1]).neg_()  # (a matmul per row: 2x the time)
    return buf


# Matrix-vector products as (1, ·) row vectors times a matrix: bmm with a one-column output runs 5-10x slower
# on CPU than the same product with a one-row output (and a 65-column output ~25 % slower than 64 columns).
def _rows_dot(x: Tensor, z: Tensor) -> Tensor:
    """x (B,H,R,D), z (B,H,D) -> x z (B,H,R)."""
    return (z[..., None, :] @ x.transpose(-1, -2))[..., 0, :]


def _rows_weighted_sum(x: Tensor, g: Tensor) -> Tensor:
    """x (B,H,R,D), g (B,H,R) -> x^T g (B,H,D)."""
    return (g[..., None, :] @ x)[..., 0, :]


# Groups of chunks of causal LLN (``_groups``): their temporaries are working-size, not N-size.
_MIN_PASSES = 16  # causal LLN: a group's temporaries stay a small fraction of an (N, D) tensor
_MIN_GROUP_ROWS = 256  # and at least this many rows: below N = 4096 more groups cost more time than they save memory


def _work_rows(x: Tensor, multiple: int = 1) -> int:
    """Rows per pass so that one (B,H,rows,D) temporary holds about ``working_set.WORK_ELEMENTS`` values."""
    b, h, _, d = x.shape
    return max(1, working_set.WORK_ELEMENTS // (b * h * d * multiple)) * multiple


def _scaled_key_rows(x: LLNInputs, r0: int, r1: int) -> Tensor:
    """beta k of rows [r0, r1), -inf on padded keys: a fresh (B,H,r1-r0,D) tensor."""
    bk = torch.mul(x.k[:, :, r0:r1], x.beta)
    if x.mask is not None:
        bk.masked_fill_(x.mask[:, None, r0:r1, None], float("-inf"))
    return bk


def _query_features(x: LLNInputs, shift: Tensor, r0: int, r1: int) -> Tensor:
    """phi_q = exp(alpha q + shift - max_d) for rows [r0, r1) (LLN eq. 8, stabilised), in place on one temporary."""
    a = torch.mul(x.q[:, :, r0:r1], x.alpha).add_(shift)
    return a.sub_(a.amax(-1, keepdim=True)).exp_()


def _key_shift(x: LLNInputs) -> Tensor:
    """M_d = max over unpadded keys of beta k_jd (B,H,1,D), 0 where no key (beta > 0: max(beta k) = beta max k)."""
    m = None
    step = _work_rows(x.k)
    for r0 in range(0, x.k.shape[2], step):
        kk = x.k[:, :, r0:r0 + step]
        if x.mask is not None:
            kk = kk.masked_fill(x.mask[:, None, r0:r0 + step, None], float("-inf"))
        part = kk.amax(2, keepdim=True)
        m = part if m is None else torch.maximum(m, part)
    return _finite_or_zero(m * x.beta)


def _noncausal_forward(x: LLNInputs, out: Tensor) -> _NoncausalState:
    """out = phi_q S / phi_q z with S = sum_j phi_k(k_j) v_j^T, z = sum_j phi_k(k_j) (LLN eq. 8-9), into ``out``.

    Returns what the backward needs. The shifts cancel exactly between numerator and denominator, so they are
    constants for the gradient.
    """
    q, k = x.q, x.k
    m = _key_shift(x)
    s = q.new_zeros(*q.shape[:2], q.shape[-1], x.v.shape[-1] + 1)
    step = _work_rows(k)
    for r0 in range(0, k.shape[2], step):
        fk = _scaled_key_rows(x, r0, r0 + step).sub_(m).exp_()
        s[..., :-1] += fk.transpose(-1, -2) @ x.v[:, :, r0:r0 + step]
        s[..., -1] += fk.sum(2)
    den = q.new_empty(*q.shape[:3], 1)
    step = _work_rows(q)
    for r0 in range(0, q.shape[2], step):
        _noncausal_rows(x, m, s, r0, r0 + step, den, out[:, :, r0:r0 + step])
    return _NoncausalState(m, s, den)


def _noncausal_rows(x: LLNInputs, m: Tensor, s: Tensor, r0: int, r1: int, den: Optional[Tensor], out: Tensor):
    """Rows [r0, r1) of the output (and of den unless None); returns their phi_q."""
    fq = _query_features(x, m, r0, r1)
    d = _rows_dot(fq, s[..., -1]).clamp_min_(_TINY)[..., None]
    if den is not None:
        den[:, :, r0:r1] = d
    torch.div(fq @ s[..., :-1], d, out=out)
    return fq


def _noncausal_backward(x: LLNInputs, state: _NoncausalState, upstream: _OutputGrad, grads: _Grads) -> None:
    """dq, dk, dv of non-causal LLN (four matmuls per pass); the output, if not given, is rebuilt per pass."""
    q, k = x.q, x.k
    m, s, den = state
    ds = torch.zeros_like(s)  # [dL/dS, dL/dz]
    step = _work_rows(q)
    for r0 in range(0, q.shape[2], step):
        r1 = r0 + step
        if upstream.out is None:
            o = q.new_empty(*upstream.grad[:, :, r0:r1].shape)
            fq = _noncausal_rows(x, m, s, r0, r1, None, o)
        else:
            o, fq = upstream.out[:, :, r0:r1], _query_features(x, m, r0, r1)
        go = _output_grad(upstream.grad[:, :, r0:r1], o, den[:, :, r0:r1])
        if upstream.scale != 1:
            go.mul_(upstream.scale)
        ds[..., :-1] += fq.transpose(-1, -2) @ go[..., :-1]
        ds[..., -1] += _rows_weighted_sum(fq, go[..., -1].contiguous())
        torch.mul((go @ s.transpose(-1, -2)).mul_(fq), x.alpha, out=grads.dq[:, :, r0:r1])
    step = _work_rows(k)
    for r0 in range(0, k.shape[2], step):
        r1 = r0 + step
        fk = _scaled_key_rows(x, r0, r1).sub_(m).exp_()
        dfk = (x.v[:, :, r0:r1] @ ds[..., :-1].transpose(-1, -2)).add_(ds[..., None, :, -1])  # [v, 1] [dS, dz]^T
        torch.mul(dfk.mul_(fk), x.beta, out=grads.dk[:, :, r0:r1])
        torch.matmul(fk, ds[..., :-1], out=grads.dv[:, :, r0:r1])


class _Scratch:
    """The working buffers of one pass over the groups of chunks, reused by every group: each is allocated
    (and page-faulted) once per pass instead of once per group (glibc hands freed blocks back to the
    system above its trim threshold, so a fresh temporary per group costs page faults every time)."""

    def __init__(self, like: Tensor):
        self.like, self.buffers = like, {}

    def __call__(self, name: str, *shape: int) -> Tensor:
        """An uninitialised contiguous tensor of ``shape``: the same memory on every call with ``name``."""
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = self.like.new_empty(numel)
        return buf[:numel].view(shape)


def _group_rows(buf: Tensor, x: Tensor, scale: Optional[Tensor], r0: int, c: int, fill: float) -> Tensor:
    """buf (B,H,R,·) <- rows [r0, r0+R) of x (times ``scale``), ``fill`` past the end; as (B,H,R/c,c,·) chunks."""
    m = min(buf.shape[2], x.shape[2] - r0)
    if scale is None:
        buf[:, :, :m] = x[:, :, r0:r0 + m]
    else:
        torch.mul(x[:, :, r0:r0 + m], scale, out=buf[:, :, :m])
    buf[:, :, m:] = fill
    return buf.unflatten(2, (-1, c))


def _scaled_key_chunks(buf: Tensor, k: Tensor, beta: Tensor, mask: Optional[Tensor], r0: int, c: int) -> Tensor:
    """beta k of the rows of ``buf`` from r0 as chunks, -inf on padded keys and past the end."""
    bk = _group_rows(buf, k, beta, r0, c, float("-inf"))
    if mask is not None:
        m = min(buf.shape[2], k.shape[2] - r0)
        buf[:, :, :m].masked_fill_(mask[:, None, r0:r0 + m, None], float("-inf"))
    return bk


def _chunk_shifts(x: LLNInputs, groups: List[Tuple[int, int]]) -> Tuple[Tensor, Tensor, Tensor]:
    """Key shifts of the chunks of c keys that use no future token (no gradient), (B,H,nc,D) each.

    m_incl, m_prev: per-feature max of beta k over chunks <= c and < c (0 when none); decay rescales
    the state from m_prev[c] to m_incl[c] (= m_prev[c+1]).
    """
    b, h, n, d = x.k.shape
    c = x.chunk
    top = x.k.new_empty(b, h, -(-n // c), d)
    ws = _Scratch(x.k)
    for g0, g1 in groups:
        bk = _scaled_key_chunks(ws("bk", b, h, (g1 - g0) * c, d), x.k, x.beta, x.mask, g0 * c, c)
        torch.amax(bk, 3, out=top[:, :, g0:g1])
    m_incl = torch.cummax(top, dim=2).values
    m_prev = torch.cat([torch.full_like(m_incl[:, :, :1], float("-inf")), m_incl[:, :, :-1]], 2)
    decay = torch.where(torch.isfinite(m_prev), torch.exp(m_prev - _finite_or_zero(m_incl)), torch.zeros_like(m_prev))
    return _finite_or_zero(m_incl), _finite_or_zero(m_prev), decay


def _groups(x: LLNInputs) -> List[Tuple[int, int]]:
    """The groups of chunks [g0, g1) processed together: their temporaries are working-size, not N-size."""
    n, c = x.q.shape[2], x.chunk
    per = max(1, min(_work_rows(x.q, c), max(n // _MIN_PASSES, _MIN_GROUP_ROWS)) // c)
    nc = -(-n // c)
    return [(g0, min(g0 + per, nc)) for g0 in range(0, nc, per)]


def _causal_group(x: LLNInputs, state: _CausalState, group: Tuple[int, int], ws: _Scratch):
    """The features of the chunks [g0, g1) of ``group`` (B,H,G,C,·) in ``ws``'s buffers: phi_q, phi_k referenced to
    m_prev and to m_incl, [v, 1], the key excesses g, their running max rho and the intra-chunk scale
    e^(g_j - rho_i) for j <= i (0 above the diagonal)."""
    b, h, _, d = x.q.shape
    (g0, g1), c = group, x.chunk
    rows = (g1 - g0) * c
    mp, mi = state.m_prev[:, :, g0:g1, None], state.m_incl[:, :, g0:g1, None]
    bk = _scaled_key_chunks(ws("bk", b, h, rows, d), x.k, x.beta, x.mask, g0 * c, c)
    fki = torch.sub(bk, mi, out=ws("fki", *bk.shape)).exp_()  # builds the next state
    bk.sub_(mp)
    g = bk.amax(-1).clamp_min_(0)  # a key's excess over m_prev (its own scalar shift)
    fk = bk.sub_(g[..., None]).exp_()
    rho = torch.cummax(g, dim=-1).values  # per query: the largest shift among the keys it sees
    a = _group_rows(ws("fq", b, h, rows, d), x.q, x.alpha, g0 * c, c, 0.0).add_(mp)
    fq = a.sub_(a.amax(-1, keepdim=True)).exp_()
    v1 = ws("v1", b, h, rows, x.v.shape[-1] + 1)
    v1[..., -1] = 1  # [v, 1]: the last column turns every value sum into the matching denominator sum
    _group_rows(v1[..., :-1], x.v, None, g0 * c, c, 0.0)
    future = torch.ones(c, c, dtype=torch.bool, device=x.q.device).triu(1)
    # g_j - rho_i <= 0 for j <= i; above the diagonal it is clamped and the scale zeroed after the exp (an exp of
    # -inf, or of anything below log(float32 tiny) ~ -87, takes torch's slow path: 2-35x the time)
    e = torch.sub(g[..., None, :], rho[..., :, None], out=ws("e", *g.shape, c)).clamp_max_(0).exp_()
    return fq, fk, fki, v1.unflatten(2, (-1, c)), g, rho, e.masked_fill_(future, 0.0)


def _causal_forward(x: LLNInputs, out: Tensor) -> _CausalState:
    """Chunked causal LLN into ``out``; returns what ``_causal_backward`` needs.

    Inside a chunk: W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i) for j <= i (masked C×C product);
    across chunks: the state S_c = sum over chunks < c of phi_k(k_j) [v_j, 1]^T, scanned with the
    rescaling ``decay`` as the key shift grows (online-softmax style). Chunks are processed in groups
    of working size, the scan carried from group to group, every group in the same working buffers.
    The state kept is S_c (B,H,nc+1,D,Dv+1), the per-chunk shifts and the denominators; the backward
    rebuilds every feature.
    """
    b, h, n, d = x.q.shape
    groups = _groups(x)
    shifts = _chunk_shifts(x, groups)
    s = x.q.new_empty(b, h, -(-n // x.chunk) + 1, d, x.v.shape[-1] + 1)
    s[:, :, 0] = 0
    state = _CausalState(s, *shifts, x.q.new_empty(b, h, n, 1))
    ws = _Scratch(x.q)
    for group in groups:
        _causal_forward_group(x, state, group, out, ws)
    return state


def _causal_backward(x: LLNInputs, state: _CausalState, upstream: _OutputGrad, grads: _Grads) -> None:
    """dq, dk, dv of causal LLN: the groups in reverse, carrying dL/dS (the output, if not given, rebuilt)."""
    carry = torch.zeros_like(state.s[:, :, 0])  # total dL/dS of the first chunk after the group
    ws = _Scratch(x.q)
    for group in reversed(_groups(x)):
        carry = _causal_backward_group(x, state, group, upstream, carry, grads, ws)


def _intra_weights(fq, fk, e, ws: _Scratch) -> Tensor:
    """W = phi_q phi_k^T e^(g_j - rho_i), j <= i, inside each chunk of a group (B,H,G,C,C)."""
    return torch.matmul(fq, fk.transpose(-1, -2), out=ws("w", *e.shape)).mul_(e)


def _group_numerator(w, v1, fqr, s_prev, ws: _Scratch) -> Tensor:
    """[numerator, denominator] of a group's queries (B,H,G,C,Dv+1): W [v, 1] inside the chunks, plus
    phi_q e^(-rho) S_c from the chunks before (``fqr`` = phi_q e^(-rho))."""
    o = torch.matmul(w, v1, out=ws("o", *v1.shape))
    return o.add_(torch.matmul(fqr, s_prev, out=ws("o_state", *v1.shape)))


def _states_before(s: Tensor, g0: int, g1: int, ws: _Scratch) -> Tensor:
    """S_c of chunks [g0, g1) (B,H,G,D,Dv+1), copied into a working buffer (a matmul would copy the strided slice
    into a fresh temporary)."""
    return ws("s_prev", *s[:, :, g0:g1].shape).copy_(s[:, :, g0:g1])


def _causal_forward_group(x: LLNInputs, state: _CausalState, group: Tuple[int, int], out: Tensor, ws: _Scratch):
    """The chunks [g0, g1) of ``group``: their states S_(c+1) into the state's s, their rows of out and den."""
    (g0, g1), c, s, den = group, x.chunk, state.s, state.den
    fq, fk, fki, v1, g, rho, e = _causal_group(x, state, group, ws)
    s[:, :, g0 + 1:g1 + 1] = torch.matmul(fki.transpose(-1, -2), v1, out=ws("s_prev", *s[:, :, g0:g1].shape))  # U_c
    linear_scan_(s[:, :, g0:g1 + 1], F.pad(state.decay[:, :, g0:g1], (0, 0, 1, 0)))  # S_(c+1) = S_c decay_c + U_c
    fqr = torch.mul(fq, torch.exp(-rho)[..., None], out=ws("fqr", *fq.shape))
    o = _group_numerator(_intra_weights(fq, fk, e, ws), v1, fqr, _states_before(s, g0, g1, ws), ws)
    o = o.flatten(2, 3)[:, :, :x.q.shape[2] - g0 * c]
    r0, r1 = g0 * c, g0 * c + o.shape[2]
    torch.clamp_min(o[..., -1:], _TINY, out=den[:, :, r0:r1])
    torch.div(o[..., :-1], den[:, :, r0:r1], out=out[:, :, r0:r1])


def _causal_backward_group(x: LLNInputs, state: _CausalState, group: Tuple[int, int], upstream: _OutputGrad,
                           carry: Tensor, grads: _Grads, ws: _Scratch) -> Tensor:
    """The chunks [g0, g1) of ``group``: their rows of dq, dk, dv; returns the total dL/dS_(g0) for the group
    before."""
    (g0, g1), c, den = group, x.chunk, state.den
    fq, fk, fki, v1, g, rho, e = _causal_group(x, state, group, ws)
    r0, r1 = g0 * c, min(g1 * c, x.q.shape[2])
    r = torch.exp(-rho)[..., None]
    fqr = torch.mul(fq, r, out=ws("fqr", *fq.shape))
    wt = _intra_weights(fq, fk, e, ws)
    s_prev = _states_before(state.s, g0, g1, ws)
    if upstream.out is None:  # the forward's output, rebuilt: numerator / denominator
        o = _group_numerator(wt, v1, fqr, s_prev, ws).flatten(2, 3)[:, :, :r1 - r0]
        o_out = o[..., :-1].div_(den[:, :, r0:r1])
    else:
        o_out = upstream.out[:, :, r0:r1]
    # working buffers shared by values whose lifetimes do not overlap (fewer buffers, less peak memory): go in
    # o_state (read only to build o), the queries' dL/dS in o, dL/dU in s_prev, dL/dphi_k in fqr
    go = ws("o_state", *v1.shape).flatten(2, 3)  # dL/d[numerator, denominator], 0 past the end
    _output_grad(upstream.grad[:, :, r0:r1], o_out, den[:, :, r0:r1], go[:, :, :r1 - r0])
    go[:, :, r1 - r0:] = 0
    if upstream.scale != 1:
        go.mul_(upstream.scale)
    go = go.unflatten(2, (-1, c))
    dv_group = torch.matmul(wt.transpose(-1, -2), go[..., :-1], out=ws("dv", *go[..., :-1].shape))  # through W
    dp = torch.matmul(go, v1.transpose(-1, -2), out=wt).mul_(e)  # dL/d(phi_q phi_k^T) inside chunks (W's buffer)
    dfq = torch.matmul(go, s_prev.transpose(-1, -2), out=ws("dfq", *fq.shape)).mul_(r)
    dfq.add_(torch.matmul(dp, fk, out=ws("prod", *fq.shape)))
    ds = ws("ds", *carry.shape[:2], g1 - g0 + 1, *carry.shape[2:])  # dL/dS_c from chunk c's queries, then carry
    ds[:, :, :-1] = torch.matmul(fqr.transpose(-1, -2), go, out=ws("o", *ds[:, :, :-1].shape))
    ds[:, :, -1] = carry
    linear_scan_(ds, F.pad(state.decay[:, :, g0:g1], (0, 0, 0, 1)), reverse=True)  # + decay_c dL/dS_(c+1)
    du = ws("s_prev", *s_prev.shape).copy_(ds[:, :, 1:])  # U_c enters S_(c+1) onwards
    dfk = torch.matmul(dp.transpose(-1, -2), fq, out=ws("fqr", *fk.shape))
    torch.mul(dfq.mul_(fq).flatten(2, 3)[:, :, :r1 - r0], x.alpha, out=grads.dq[:, :, r0:r1])
    dv_group += torch.matmul(fki, du[..., :-1], out=ws("o", *dv_group.shape))
    grads.dv[:, :, r0:r1] = dv_group.flatten(2, 3)[:, :, :r1 - r0]
    dbk = dfk.mul_(fk).addcmul_(torch.matmul(v1, du.transpose(-1, -2), out=ws("prod", *fk.shape)), fki)
    torch.mul(dbk.flatten(2, 3)[:, :, :r1 - r0], x.beta, out=grads.dk[:, :, r0:r1])
    return ds[:, :, 0].clone()

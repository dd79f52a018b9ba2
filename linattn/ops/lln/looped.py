"""LLN's fast CPU form: passes over rows of working size (non-causal) and groups of chunks (causal).

q, k (B,H,N,D), v (B,H,N,Dv), alpha, beta (B|1,H|1,1,1), mask (B,S) or None; outputs and gradients are written
into given buffers, so that LLN+Diag can add its block softmax into the same ones.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import working_set
from .features import _TINY, _finite_or_zero


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


# Groups of chunks of causal LLN (``_causal_forward``): their temporaries are working-size, not N-size.
_MIN_PASSES = 16  # causal LLN: a group's temporaries stay a small fraction of an (N, D) tensor
_MIN_GROUP_ROWS = 256  # and at least this many rows: below N = 4096 more groups cost more time than they save memory


def _work_rows(x: Tensor, multiple: int = 1) -> int:
    """Rows per pass so that one (B,H,rows,D) temporary holds about ``working_set.WORK_ELEMENTS`` values."""
    b, h, _, d = x.shape
    return max(1, working_set.WORK_ELEMENTS // (b * h * d * multiple)) * multiple


def _scaled_keys(k: Tensor, beta: Tensor, mask: Optional[Tensor], r0: int, r1: int) -> Tensor:
    """beta k of rows [r0, r1), -inf on padded keys: a fresh (B,H,r1-r0,D) tensor."""
    bk = torch.mul(k[:, :, r0:r1], beta)
    if mask is not None:
        bk.masked_fill_(mask[:, None, r0:r1, None], float("-inf"))
    return bk


def _query_features(q: Tensor, alpha: Tensor, shift: Tensor, r0: int, r1: int) -> Tensor:
    """phi_q = exp(alpha q + shift - max_d) for rows [r0, r1) (LLN eq. 8, stabilised), in place on one temporary."""
    a = torch.mul(q[:, :, r0:r1], alpha).add_(shift)
    return a.sub_(a.amax(-1, keepdim=True)).exp_()


def _key_shift(k: Tensor, beta: Tensor, mask: Optional[Tensor]) -> Tensor:
    """M_d = max over unpadded keys of beta k_jd (B,H,1,D), 0 where no key (beta > 0: max(beta k) = beta max k)."""
    m = None
    step = _work_rows(k)
    for r0 in range(0, k.shape[2], step):
        kk = k[:, :, r0:r0 + step]
        if mask is not None:
            kk = kk.masked_fill(mask[:, None, r0:r0 + step, None], float("-inf"))
        part = kk.amax(2, keepdim=True)
        m = part if m is None else torch.maximum(m, part)
    return _finite_or_zero(m * beta)


def _noncausal_forward(q, k, v, alpha, beta, mask, out):
    """out = phi_q S / phi_q z with S = sum_j phi_k(k_j) v_j^T, z = sum_j phi_k(k_j) (LLN eq. 8-9), into ``out``.

    Returns what the backward needs: the key shift m (B,H,1,D), S = [sum phi_k v^T, sum phi_k]
    (B,H,D,Dv+1) and the denominators (B,H,N,1). The shifts cancel exactly between numerator and
    denominator, so they are constants for the gradient.
    """
    m = _key_shift(k, beta, mask)
    s = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1] + 1)
    step = _work_rows(k)
    for r0 in range(0, k.shape[2], step):
        fk = _scaled_keys(k, beta, mask, r0, r0 + step).sub_(m).exp_()
        s[..., :-1] += fk.transpose(-1, -2) @ v[:, :, r0:r0 + step]
        s[..., -1] += fk.sum(2)
    den = q.new_empty(*q.shape[:3], 1)
    step = _work_rows(q)
    for r0 in range(0, q.shape[2], step):
        _noncausal_rows(q, alpha, m, s, r0, r0 + step, den, out[:, :, r0:r0 + step])
    return m, s, den


def _noncausal_rows(q, alpha, m, s, r0, r1, den, out):
    """Rows [r0, r1) of the output (and of den unless None); returns their phi_q."""
    fq = _query_features(q, alpha, m, r0, r1)
    d = _rows_dot(fq, s[..., -1]).clamp_min_(_TINY)[..., None]
    if den is not None:
        den[:, :, r0:r1] = d
    torch.div(fq @ s[..., :-1], d, out=out)
    return fq


def _noncausal_backward(q, k, v, alpha, beta, mask, state, out, grad, gscale, dq, dk, dv) -> None:
    """dq, dk, dv of ``gscale`` * non-causal LLN (four matmuls per pass); ``out`` None: rebuilt per pass."""
    m, s, den = state
    ds = torch.zeros_like(s)  # [dL/dS, dL/dz]
    step = _work_rows(q)
    for r0 in range(0, q.shape[2], step):
        r1 = r0 + step
        if out is None:
            o = q.new_empty(*grad[:, :, r0:r1].shape)
            fq = _noncausal_rows(q, alpha, m, s, r0, r1, None, o)
        else:
            o, fq = out[:, :, r0:r1], _query_features(q, alpha, m, r0, r1)
        go = _output_grad(grad[:, :, r0:r1], o, den[:, :, r0:r1])
        if gscale != 1:
            go.mul_(gscale)
        ds[..., :-1] += fq.transpose(-1, -2) @ go[..., :-1]
        ds[..., -1] += _rows_weighted_sum(fq, go[..., -1].contiguous())
        torch.mul((go @ s.transpose(-1, -2)).mul_(fq), alpha, out=dq[:, :, r0:r1])
    step = _work_rows(k)
    for r0 in range(0, k.shape[2], step):
        r1 = r0 + step
        fk = _scaled_keys(k, beta, mask, r0, r1).sub_(m).exp_()
        dfk = (v[:, :, r0:r1] @ ds[..., :-1].transpose(-1, -2)).add_(ds[..., None, :, -1])  # [v, 1] [dS, dz]^T
        torch.mul(dfk.mul_(fk), beta, out=dk[:, :, r0:r1])
        torch.matmul(fk, ds[..., :-1], out=dv[:, :, r0:r1])


def _linear_scan_(x: Tensor, a: Tensor, reverse: bool = False) -> None:
    """In place along dim 2: x[c] <- x[c] + a[c] * x[c-1] (the updated x[c-1]); a is overwritten.

    x (B,H,L,D,E), a (B,H,L,D) multipliers broadcast over E; ``reverse`` runs from the end
    (x[c] <- x[c] + a[c] * x[c+1]). A work-efficient (Brent-Kung) scan: 2 log2(L) strided in-place
    updates instead of L small ones, each combining an earlier partial result (a1, x1) into a later
    one (a2, x2) as (a2 a1, x2 + a2 x1). Every multiplier is a product of decays <= 1: no overflow.
    """
    length = x.shape[2]

    def combine(start: int, step: int, span: int) -> None:
        count = len(range(start, length, step))  # later elements, in scan order
        if not count:
            return
        first = start if not reverse else length - 1 - start - (count - 1) * step
        earlier = first - span if not reverse else first + span
        later, later_a = x[:, :, first::step][:, :, :count], a[:, :, first::step][:, :, :count]
        prev, prev_a = x[:, :, earlier::step][:, :, :count], a[:, :, earlier::step][:, :, :count]
        later.addcmul_(prev, later_a[..., None])
        later_a.mul_(prev_a)

    span = 1
    while span < length:  # up-sweep: x[i] aggregates the block of 2*span elements ending at i
        combine(2 * span - 1, 2 * span, span)
        span *= 2
    while span > 1:  # down-sweep: complete the prefixes in between
        span //= 2
        combine(3 * span - 1, 2 * span, span)


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


def _chunk_shifts(k: Tensor, beta: Tensor, mask: Optional[Tensor], c: int, groups) -> Tuple[Tensor, Tensor, Tensor]:
    """Key shifts of the chunks of c keys that use no future token (no gradient), (B,H,nc,D) each.

    m_incl, m_prev: per-feature max of beta k over chunks <= c and < c (0 when none); decay rescales
    the state from m_prev[c] to m_incl[c] (= m_prev[c+1]).
    """
    b, h, n, d = k.shape
    top = k.new_empty(b, h, -(-n // c), d)
    ws = _Scratch(k)
    for g0, g1 in groups:
        bk = _scaled_key_chunks(ws("bk", b, h, (g1 - g0) * c, d), k, beta, mask, g0 * c, c)
        torch.amax(bk, 3, out=top[:, :, g0:g1])
    m_incl = torch.cummax(top, dim=2).values
    m_prev = torch.cat([torch.full_like(m_incl[:, :, :1], float("-inf")), m_incl[:, :, :-1]], 2)
    decay = torch.where(torch.isfinite(m_prev), torch.exp(m_prev - _finite_or_zero(m_incl)), torch.zeros_like(m_prev))
    return _finite_or_zero(m_incl), _finite_or_zero(m_prev), decay


def _causal_group(q, k, v, alpha, beta, mask, m_incl, m_prev, c, g0, g1, ws: _Scratch):
    """The features of chunks [g0, g1) (B,H,G,C,·) in ``ws``'s buffers: phi_q, phi_k referenced to m_prev
    and to m_incl, [v, 1], the key excesses g, their running max rho and the intra-chunk scale
    e^(g_j - rho_i) for j <= i (0 above the diagonal)."""
    b, h, _, d = q.shape
    rows = (g1 - g0) * c
    mp, mi = m_prev[:, :, g0:g1, None], m_incl[:, :, g0:g1, None]
    bk = _scaled_key_chunks(ws("bk", b, h, rows, d), k, beta, mask, g0 * c, c)
    fki = torch.sub(bk, mi, out=ws("fki", *bk.shape)).exp_()  # builds the next state
    bk.sub_(mp)
    g = bk.amax(-1).clamp_min_(0)  # a key's excess over m_prev (its own scalar shift)
    fk = bk.sub_(g[..., None]).exp_()
    rho = torch.cummax(g, dim=-1).values  # per query: the largest shift among the keys it sees
    a = _group_rows(ws("fq", b, h, rows, d), q, alpha, g0 * c, c, 0.0).add_(mp)
    fq = a.sub_(a.amax(-1, keepdim=True)).exp_()
    v1 = ws("v1", b, h, rows, v.shape[-1] + 1)
    v1[..., -1] = 1  # [v, 1]: the last column turns every value sum into the matching denominator sum
    _group_rows(v1[..., :-1], v, None, g0 * c, c, 0.0)
    future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # g_j - rho_i <= 0 for j <= i; above the diagonal it is clamped and the scale zeroed after the exp (an exp of
    # -inf, or of anything below log(float32 tiny) ~ -87, takes torch's slow path: 2-35x the time)
    e = torch.sub(g[..., None, :], rho[..., :, None], out=ws("e", *g.shape, c)).clamp_max_(0).exp_()
    return fq, fk, fki, v1.unflatten(2, (-1, c)), g, rho, e.masked_fill_(future, 0.0)


def _causal_forward(q, k, v, alpha, beta, mask, c, out):
    """Chunked causal LLN into ``out``; returns (state, groups) for ``_causal_backward``.

    Inside a chunk: W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i) for j <= i (masked C×C product);
    across chunks: the state S_c = sum over chunks < c of phi_k(k_j) [v_j, 1]^T, scanned with the
    rescaling ``decay`` as the key shift grows (online-softmax style). Chunks are processed in groups
    of working size, the scan carried from group to group, every group in the same working buffers.
    The state kept is S_c (B,H,nc+1,D,Dv+1), the per-chunk shifts and the denominators; the backward
    rebuilds every feature.
    """
    b, h, n, d = q.shape
    nc = -(-n // c)
    per = max(1, min(_work_rows(q, c), max(n // _MIN_PASSES, _MIN_GROUP_ROWS)) // c)
    groups = [(g0, min(g0 + per, nc)) for g0 in range(0, nc, per)]
    shifts = _chunk_shifts(k, beta, mask, c, groups)
    s = q.new_empty(b, h, nc + 1, d, v.shape[-1] + 1)
    s[:, :, 0] = 0
    den = q.new_empty(b, h, n, 1)
    ws = _Scratch(q)
    for g0, g1 in groups:
        _causal_forward_group(q, k, v, alpha, beta, mask, shifts, c, g0, g1, s, out, den, ws)
    return (s, *shifts, den), groups


def _causal_backward(q, k, v, alpha, beta, mask, state, groups, c, out, grad, gscale, dq, dk, dv) -> None:
    """dq, dk, dv of ``gscale`` * causal LLN: the groups in reverse, carrying dL/dS (``out`` None: rebuilt)."""
    s, m_incl, m_prev, decay, den = state
    carry = torch.zeros_like(s[:, :, 0])  # total dL/dS of the first chunk after the group
    ws = _Scratch(q)
    for g0, g1 in reversed(groups):
        carry = _causal_backward_group(q, k, v, alpha, beta, mask, (m_incl, m_prev, decay), c, g0, g1, s,
                                       den, out, grad, gscale, carry, dq, dk, dv, ws)


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


def _causal_forward_group(q, k, v, alpha, beta, mask, shifts, c, g0, g1, s, out, den, ws) -> None:
    """Chunks [g0, g1): their states S_(c+1) into s, their rows of out and den."""
    m_incl, m_prev, decay = shifts
    fq, fk, fki, v1, g, rho, e = _causal_group(q, k, v, alpha, beta, mask, m_incl, m_prev, c, g0, g1, ws)
    s[:, :, g0 + 1:g1 + 1] = torch.matmul(fki.transpose(-1, -2), v1, out=ws("s_prev", *s[:, :, g0:g1].shape))  # U_c
    _linear_scan_(s[:, :, g0:g1 + 1], F.pad(decay[:, :, g0:g1], (0, 0, 1, 0)))  # S_(c+1) = S_c decay_c + U_c
    fqr = torch.mul(fq, torch.exp(-rho)[..., None], out=ws("fqr", *fq.shape))
    o = _group_numerator(_intra_weights(fq, fk, e, ws), v1, fqr, _states_before(s, g0, g1, ws), ws)
    o = o.flatten(2, 3)[:, :, :q.shape[2] - g0 * c]
    r0, r1 = g0 * c, g0 * c + o.shape[2]
    torch.clamp_min(o[..., -1:], _TINY, out=den[:, :, r0:r1])
    torch.div(o[..., :-1], den[:, :, r0:r1], out=out[:, :, r0:r1])


def _causal_backward_group(q, k, v, alpha, beta, mask, shifts, c, g0, g1, s, den, out, grad, gscale, carry, dq, dk, dv,
                           ws):
    """Chunks [g0, g1): their rows of dq, dk, dv; returns the total dL/dS_(g0) for the group before."""
    m_incl, m_prev, decay = shifts
    fq, fk, fki, v1, g, rho, e = _causal_group(q, k, v, alpha, beta, mask, m_incl, m_prev, c, g0, g1, ws)
    r0, r1 = g0 * c, min(g1 * c, q.shape[2])
    r = torch.exp(-rho)[..., None]
    fqr = torch.mul(fq, r, out=ws("fqr", *fq.shape))
    wt = _intra_weights(fq, fk, e, ws)
    s_prev = _states_before(s, g0, g1, ws)
    if out is None:  # the forward's output, rebuilt: numerator / denominator
        o = _group_numerator(wt, v1, fqr, s_prev, ws).flatten(2, 3)[:, :, :r1 - r0]
        o_out = o[..., :-1].div_(den[:, :, r0:r1])
    else:
        o_out = out[:, :, r0:r1]
    # working buffers shared by values whose lifetimes do not overlap (fewer buffers, less peak memory): go in
    # o_state (read only to build o), the queries' dL/dS in o, dL/dU in s_prev, dL/dphi_k in fqr
    go = ws("o_state", *v1.shape).flatten(2, 3)  # dL/d[numerator, denominator], 0 past the end
    _output_grad(grad[:, :, r0:r1], o_out, den[:, :, r0:r1], go[:, :, :r1 - r0])
    go[:, :, r1 - r0:] = 0
    if gscale != 1:
        go.mul_(gscale)
    go = go.unflatten(2, (-1, c))
    dv_group = torch.matmul(wt.transpose(-1, -2), go[..., :-1], out=ws("dv", *go[..., :-1].shape))  # through W
    dp = torch.matmul(go, v1.transpose(-1, -2), out=wt).mul_(e)  # dL/d(phi_q phi_k^T) inside chunks (W's buffer)
    dfq = torch.matmul(go, s_prev.transpose(-1, -2), out=ws("dfq", *fq.shape)).mul_(r)
    dfq.add_(torch.matmul(dp, fk, out=ws("prod", *fq.shape)))
    ds = ws("ds", *carry.shape[:2], g1 - g0 + 1, *carry.shape[2:])  # dL/dS_c from chunk c's queries, then carry
    ds[:, :, :-1] = torch.matmul(fqr.transpose(-1, -2), go, out=ws("o", *ds[:, :, :-1].shape))
    ds[:, :, -1] = carry
    _linear_scan_(ds, F.pad(decay[:, :, g0:g1], (0, 0, 0, 1)), reverse=True)  # + decay_c dL/dS_(c+1)
    du = ws("s_prev", *s_prev.shape).copy_(ds[:, :, 1:])  # U_c enters S_(c+1) onwards
    dfk = torch.matmul(dp.transpose(-1, -2), fq, out=ws("fqr", *fk.shape))
    torch.mul(dfq.mul_(fq).flatten(2, 3)[:, :, :r1 - r0], alpha, out=dq[:, :, r0:r1])
    dv_group += torch.matmul(fki, du[..., :-1], out=ws("o", *dv_group.shape))
    dv[:, :, r0:r1] = dv_group.flatten(2, 3)[:, :, :r1 - r0]
    dbk = dfk.mul_(fk).addcmul_(torch.matmul(v1, du.transpose(-1, -2), out=ws("prod", *fk.shape)), fki)
    torch.mul(dbk.flatten(2, 3)[:, :, :r1 - r0], beta, out=dk[:, :, r0:r1])
    return ds[:, :, 0].clone()

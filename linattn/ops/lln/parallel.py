"""LLN's parallel implementation (for GPUs): a fixed number of batched tensor ops whatever the length, no host sync.

``forward`` and ``backward`` take ``LLNInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in the input dtype (upcast
here: half inputs compute in float32). The stabilisation is ``looped``'s (``lln/__init__``).

Non-causal: all rows in one pass. Causal: all chunks of c rows at once, (B,H,nc,c,·): masked C×C products inside
the chunks, the chunk states U_c, and the states before each chunk S_c = sum_{c' < c} T_cc' U_c' with
T_cc' = exp(M_c' - M_(c-1)) per feature d (M: the running key maximum, so T <= 1): every prefix in one batched
matmul over a (B,H,D,nc,nc) T (D (N/c)² values a head), where a scan would take 2 log2(nc) steps.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..batched import bmm, chunks, rows
from ..precision import compute_dtype
from .features import _TINY, _finite_or_zero, _with_ones
from .inputs import LLNInputs


def forward(x: LLNInputs, *, averaged: bool = False) -> Tuple[Tensor, tuple]:
    """LLN (B,H,N,Dv) in q's dtype, and what ``backward`` needs: (out, *state), out the output the causal backward
    reads (None if non-causal: rebuilt from S). ``averaged``: the caller averages another part into the output
    (as LLN+Diag), so it stays in the compute dtype and the causal backward reads a copy in q's dtype."""
    out, state = _causal_forward(x) if x.causal else _noncausal_forward(x)
    if averaged:
        return out, (out.to(x.q.dtype) if x.causal else None, *state)
    out = out.to(x.q.dtype)
    return out, (out if x.causal else None, *state)


def backward(x: LLNInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (compute dtype) of ``scale`` * LLN, from ``forward``'s ``saved`` and dL/d(out) (B,H,N,Dv)."""
    out, *state = saved
    if x.causal:
        return _causal_backward(x, state, out, grad, scale)
    return _noncausal_backward(x, state, grad, scale)


def _scaled_keys(x: LLNInputs) -> Tensor:
    """beta k in the compute dtype, -inf on padded keys (B,H,N,D)."""
    bk = x.k.to(compute_dtype(x.k)) * x.beta
    return bk if x.mask is None else bk.masked_fill(x.mask[:, None, :, None], float("-inf"))


def _scaled_output_grad(grad: Tensor, out: Tensor, den: Tensor, scale: float) -> Tensor:
    """dL/d[numerator, denominator] (...,Dv+1) from dL/d(scale out) (...,Dv), out = numerator / den; the scale
    (a caller's weight, as LLN+Diag's 0.5) divides the small den, not the (N, Dv) gradient."""
    return torch.cat([grad, -(grad * out).sum(-1, keepdim=True)], -1) / (den if scale == 1.0 else den / scale)


# -- non-causal -----------------------------------------------------------------------------------------------------

def _noncausal_features(x: LLNInputs, m: Optional[Tensor] = None):
    """phi_q (B,H,N,D), phi_k (B,H,S,D) (LLN eq. 8) shifted by the key maximum m (B,H,1,D) (computed if None)."""
    bk = _scaled_keys(x)
    if m is None:
        m = _finite_or_zero(bk.amax(2, keepdim=True))
    a = torch.addcmul(m, x.q.to(bk.dtype), x.alpha)  # alpha q + M: the query absorbs the keys' shift
    return torch.exp(a - a.amax(-1, keepdim=True)), torch.exp(bk - m), m


def _noncausal_forward(x: LLNInputs):
    """out = phi_q S / phi_q z, S = sum_j phi_k v_j^T, z = sum_j phi_k (LLN eq. 9) -> (out, (m, s, den))."""
    fq, fk, m = _noncausal_features(x)
    s = bmm(fk.transpose(-1, -2), _with_ones(x.v.to(fk.dtype)))  # [S, z] (B,H,D,Dv+1)
    o = bmm(fq, s)
    den = o[..., -1:].clamp_min(_TINY)
    return o[..., :-1] / den, (m, s, den)


def _noncausal_backward(x: LLNInputs, state, grad: Tensor, scale: float):
    """dq, dk, dv (compute dtype) of scale x LLN; the output is rebuilt from phi_q and S (one matmul)."""
    m, s, den = state
    fq, fk, _ = _noncausal_features(x, m)
    o = bmm(fq, s)
    go = _scaled_output_grad(grad.to(fq.dtype), o[..., :-1] / den, den, scale)
    ds = bmm(fq.transpose(-1, -2), go)  # [dL/dS, dL/dz]
    dq = bmm(go, s.transpose(-1, -2)).mul_(fq).mul_(x.alpha)
    v1 = _with_ones(x.v.to(fq.dtype))
    dk = bmm(v1, ds.transpose(-1, -2)).mul_(fk).mul_(x.beta)
    return dq, dk, bmm(fk, ds[..., :-1])


# -- causal ---------------------------------------------------------------------------------------------------------

def _causal_shifts(x: LLNInputs):
    """The key shifts that use no future token, feature-major (B,H,D,nc) as the prefix weights need them (a
    chunk-major layout would make T's batched matmul copy T): M_c, the running max of beta k over chunks <= c
    (-inf before any unpadded key), and its finite forms m_incl (M_c) and m_prev (M_(c-1)), 0 where -inf."""
    bk = chunks(_scaled_keys(x), x.chunk, float("-inf"))
    top = bk.permute(0, 1, 4, 2, 3).amax(-1).cummax(-1).values
    m_incl = _finite_or_zero(top)
    return bk, top, m_incl, F.pad(m_incl[..., :-1], (1, 0))


def _per_chunk(m: Tensor) -> Tensor:
    """A feature-major shift (B,H,D,nc) as a view that broadcasts over chunk rows (B,H,nc,1,D)."""
    return m.transpose(-1, -2)[:, :, :, None]


def _key_features(bk, m_incl, m_prev, g):
    """phi_k referenced to m_prev and the key's own shift g, and to m_incl (B,H,nc,c,D), from beta k."""
    return (bk - _per_chunk(m_prev)).sub_(g[..., None]).exp_(), (bk - _per_chunk(m_incl)).exp_()


def _intra_scale(g, rho):
    """e^(g_j - rho_i) (B,H,nc,c,c); g_j - rho_i <= 0 for j <= i, clamped above the diagonal (which tril drops)."""
    return (g[..., None, :] - rho[..., :, None]).clamp_max_(0).exp_()


def _prefix_weights(top, m_prev, transposed: bool = False):
    """T (B,H,D,nc,nc): T_cc' = exp(M_c' - M_(c-1)) for c' < c, else 0; M_c' = -inf (no key yet) gives 0.
    ``transposed``: T^T, built as such (a transposed T would be copied by the batched matmul)."""
    if transposed:
        return (top[..., :, None] - m_prev[..., None, :]).exp_().triu_(1)
    return (top[..., None, :] - m_prev[..., :, None]).exp_().tril_(-1)


def _overchunks(t: Tensor, x: Tensor) -> Tensor:
    """t (B,H,D,nc,nc) applied along the chunks of x (B,H,nc,D,E) for each feature d -> (B,H,nc,D,E)."""
    return bmm(t, x.transpose(2, 3).contiguous()).transpose(2, 3).contiguous()


def _values(v, c):
    """[v, 1] in the compute dtype as chunks (B,H,nc,c,Dv+1), 1 past the end (where phi_k is 0)."""
    return F.pad(v.to(compute_dtype(v)), (0, 1, 0, -v.shape[2] % c), value=1.0).unflatten(2, (-1, c))


def _causal_forward(x: LLNInputs):
    """Chunked causal LLN -> (out (B,H,N,Dv), state for ``_causal_backward``).

    Inside a chunk W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i), j <= i, where g_j >= 0 is key j's excess over
    the shift of the earlier chunks and rho_i the largest g_j of the keys query i sees; across chunks the
    states S_c, read by each query as phi_q e^(-rho) S_c (LLN eq. 9; every shift cancels exactly).
    """
    q, c = x.q, x.chunk
    n = q.shape[2]
    bk, top, m_incl, m_prev = _causal_shifts(x)
    v1 = _values(x.v, c)
    # the states first, while few temporaries are alive (each one below is dropped once used: the peak memory
    # stays a few (N, D) tensors beside the (D, nc, nc) prefix weights)
    u = bmm((bk - _per_chunk(m_incl)).exp_().transpose(-1, -2), v1)  # U_c: phi_k referenced to m_incl
    s = _overchunks(_prefix_weights(top, m_prev), u)  # S_c (B,H,nc,D,Dv+1)
    del u
    fk = bk.sub_(_per_chunk(m_prev))  # in place: beta k is not needed again
    g = fk.amax(-1).clamp_min_(0)  # a key's own scalar shift: its excess over m_prev
    rho = g.cummax(-1).values  # per query: the largest shift among the keys it sees
    fk = fk.sub_(g[..., None]).exp_()  # phi_k referenced to m_prev and g (``_key_features``)
    del bk
    a = torch.addcmul(_per_chunk(m_prev), chunks(q.to(fk.dtype), c), x.alpha[..., None])
    lse = a.amax(-1, keepdim=True)
    fq = a.sub_(lse).exp_()
    w = bmm(fq, fk.transpose(-1, -2)).mul_(_intra_scale(g, rho)).tril_()
    del fk
    r = torch.exp(-rho)[..., None]
    o = rows(torch.addcmul(bmm(w, v1), bmm(fq, s), r), n)
    del w, v1, fq
    den = o[..., -1:].clamp_min(_TINY)
    return o[..., :-1] / den, (top, m_incl, m_prev, g, rho, r, lse, s, den)


def _causal_backward(x: LLNInputs, state, out: Tensor, grad: Tensor, scale: float):
    """dq, dk, dv (compute dtype) of scale x causal LLN; the features rebuilt from the inputs and the state."""
    top, m_incl, m_prev, g, rho, r, lse, s, den = state
    q, c = x.q, x.chunk
    n = q.shape[2]
    # every temporary is dropped once used (``del``), and the (D, nc, nc) prefix weights are built while few others
    # are alive: the backward's peak memory stays a few (N, D) tensors
    fq = torch.addcmul(_per_chunk(m_prev), chunks(q.to(s.dtype), c), x.alpha[..., None]).sub_(lse).exp_()
    go = chunks(_scaled_output_grad(grad.to(fq.dtype), out.to(fq.dtype), den, scale), c)  # 0 past the end
    gor = go * r  # the queries' part through S_c, read as phi_q e^(-rho)
    du = _overchunks(_prefix_weights(top, m_prev, transposed=True), bmm(fq.transpose(-1, -2), gor))  # dL/dU_c
    dfq = bmm(gor, s.transpose(-1, -2))
    del gor
    bk = chunks(_scaled_keys(x), c, float("-inf"))
    fk, fki = _key_features(bk, m_incl, m_prev, g)
    del bk
    v1 = _values(x.v, c)
    e = _intra_scale(g, rho)
    dqk = bmm(go, v1.transpose(-1, -2)).mul_(e).tril_()  # dL/d(phi_q phi_k^T) inside the chunks
    dfq = bmm(dqk, fk, add=dfq)
    w = bmm(fq, fk.transpose(-1, -2)).mul_(e).tril_()
    del e
    dv1 = bmm(fki, du, add=bmm(w.transpose(-1, -2), go))
    del w, go
    dv = rows(dv1[..., :-1], n)
    del dv1
    dbk = torch.addcmul(bmm(dqk.transpose(-1, -2), fq).mul_(fk), bmm(v1, du.transpose(-1, -2)), fki)
    del dqk, fk, fki, v1, du
    dk = rows(dbk.mul_(x.beta[..., None]), n)
    del dbk
    return rows(dfq.mul_(fq).mul_(x.alpha[..., None]), n), dk, dv

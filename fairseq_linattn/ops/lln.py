"""Linear Log-Normal attention (LLN, Nahshan et al., eq. 8-9): phi_q = exp(alpha q), phi_k = exp(beta k).

out_i = phi_q(q_i)^T sum_j phi_k(k_j) v_j^T / phi_q(q_i)^T sum_l phi_k(k_l)   (sums over j <= i if causal)

Stabilisation (every shift cancels exactly between numerator and denominator):
- keys are shifted per feature d by a max over keys the query may see (M_d), so that
  z_d = sum_j exp(beta k_jd - M_d) >= 1; the query absorbs exp(M_d) and is shifted by its own max;
- in causal mode M comes from *earlier chunks only*; a key of the current chunk that exceeds it
  carries its own scalar shift g_j >= 0, and each query row is referenced to the running max of g
  over the keys it sees. No output depends on a future token, even through rounding.
"""
from typing import Optional

import torch
from torch import Tensor

from ._checks import (Rows, allowed_keys, autocast_off, check_key_padding_mask, check_positive_int,
                      check_positive_scale, check_qkv, compute_dtype, masked_softmax, select_rows)

_TINY = 1e-30


def _prepare(q, k, v, alpha, beta, key_padding_mask, same_length):
    """Validated, scaled inputs in the compute dtype: (alpha q, beta k with -inf on pads, v)."""
    check_qkv(q, k, v, same_length=same_length)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    ct = compute_dtype(q)
    aq = check_positive_scale("alpha", alpha, q).to(ct) * q.to(ct)
    bk = check_positive_scale("beta", beta, q).to(ct) * k.to(ct)
    if key_padding_mask is not None:
        bk = bk.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    return aq, bk, v.to(ct)


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _divide(o: Tensor) -> Tensor:
    """[numerator, denominator] -> numerator / denominator; 0 where no key was visible."""
    return o[..., :-1] / o[..., -1:].clamp_min(_TINY)


def _split_divide(o: Tensor):
    """[numerator, denominator] -> (numerator / denominator, the clamped denominator (...,1))."""
    den = o[..., -1:].clamp_min(_TINY)
    return o[..., :-1] / den, den


def _with_ones(v: Tensor) -> Tensor:
    """[v, 1]: the last column turns every value sum into the matching denominator sum."""
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)


def _output_grad(grad: Tensor, out: Tensor, den: Tensor) -> Tensor:
    """dL/d[numerator, denominator] from dL/d(out), out = numerator / den."""
    gn = grad / den
    return torch.cat([gn, -(gn * out).sum(-1, keepdim=True)], -1)


class _LLNNonCausal(torch.autograd.Function):
    """out = phi_q S / phi_q z with S = sum_j phi_k(k_j) v_j^T, z = sum_j phi_k(k_j) (LLN eq. 8-9).

    The backward is written out (four matmuls) and keeps only phi_q, phi_k, [v, 1], S and the
    output: autograd would store every elementwise intermediate. The shifts cancel exactly between
    numerator and denominator, so they are constants for the gradient.
    """

    @staticmethod
    def forward(ctx, aq: Tensor, bk: Tensor, v: Tensor) -> Tensor:
        m = _finite_or_zero(bk.amax(2, keepdim=True))  # (B,H,1,D) per-feature key shift
        fk = (bk - m).exp_()
        v1 = _with_ones(v)
        s = fk.transpose(-1, -2) @ v1  # (B,H,D,Dv+1): [sum_j phi_k v_j^T, sum_j phi_k]
        a = aq + m
        fq = a.sub_(a.amax(-1, keepdim=True)).exp_()
        out, den = _split_divide(fq @ s)
        ctx.save_for_backward(fq, fk, v1, s, den, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        fq, fk, v1, s, den, out = ctx.saved_tensors
        go = _output_grad(grad, out, den)  # (B,H,N,Dv+1)
        ds = fq.transpose(-1, -2) @ go
        daq = (go @ s.transpose(-1, -2)).mul_(fq)
        dbk = (v1 @ ds.transpose(-1, -2)).mul_(fk)
        dv = fk @ ds[..., :-1]
        return daq, dbk, dv


def _lln_noncausal(aq: Tensor, bk: Tensor, v: Tensor) -> Tensor:
    return _LLNNonCausal.apply(aq, bk, v)


def _chunk_shifts(bk: Tensor):
    """Shifts of the chunked keys bk (B,H,nc,C,D) that use no future token (no gradient).

    m_incl, m_prev (B,H,nc,D): per-feature max over chunks <= c and < c (0 when none);
    decay (B,H,nc,D) rescales the state from m_prev[c] to m_incl[c] (= m_prev[c+1]);
    g (B,H,nc,C): a key's excess over m_prev[c], rho (B,H,nc,C): the running max of g (per query).
    """
    m_incl = torch.cummax(bk.amax(3), dim=2).values
    m_prev = torch.cat([torch.full_like(m_incl[:, :, :1], float("-inf")), m_incl[:, :, :-1]], 2)
    decay = torch.where(torch.isfinite(m_prev), torch.exp(m_prev - _finite_or_zero(m_incl)), torch.zeros_like(m_prev))
    m_incl, m_prev = _finite_or_zero(m_incl), _finite_or_zero(m_prev)
    g = (bk - m_prev[:, :, :, None]).amax(-1).clamp_min(0)
    rho = torch.cummax(g, dim=-1).values
    return m_incl, m_prev, decay, g, rho


class _LLNCausal(torch.autograd.Function):
    """Chunked causal LLN on (B,H,nc,C,·) tensors with a hand-written backward.

    Inside a chunk: W_ij = phi_q(q_i)·phi_k(k_j) e^(g_j - rho_i) for j <= i (masked C×C product);
    across chunks: the state S_c = sum over chunks < c of phi_k(k_j) [v_j, 1]^T, scanned with the
    rescaling ``decay`` as the key shift grows (online-softmax style). Saves phi_q, phi_k (both
    shifts), W, the states and the output: O(N (D + C) + (N/C) D Dv) memory.
    """

    @staticmethod
    def forward(ctx, aq: Tensor, bk: Tensor, v: Tensor) -> Tensor:
        m_incl, m_prev, decay, g, rho = _chunk_shifts(bk)
        v1 = _with_ones(v)
        fki = (bk - m_incl[:, :, :, None]).exp_()  # phi_k referenced to m_incl: builds the next state
        u = fki.transpose(-1, -2) @ v1  # (B,H,nc,D,Dv+1): chunk c's contribution to S_(c+1)
        _linear_scan_(u, decay.clone())  # u[c] <- S_(c+1) = S_c * decay_c + U_c
        s = torch.zeros_like(u)
        s[:, :, 1:] = u[:, :, :-1]  # the state before each chunk
        a = aq + m_prev[:, :, :, None]
        fq = a.sub_(a.amax(-1, keepdim=True)).exp_()
        fk = (bk - m_prev[:, :, :, None] - g[..., None]).exp_()
        e = _intra_scale(g, rho)
        w = (fq @ fk.transpose(-1, -2)).mul_(e)  # (B,H,nc,C,C) intra-chunk weights
        o = (fq * torch.exp(-rho)[..., None]) @ s
        o += w @ v1
        out, den = _split_divide(o)
        ctx.save_for_backward(fq, fk, fki, w, e, v1, s, decay, rho, den, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        fq, fk, fki, w, e, v1, s, decay, rho, den, out = ctx.saved_tensors
        go = _output_grad(grad, out, den)  # dL/d[numerator, denominator], (B,H,nc,C,Dv+1)
        dp = (go @ v1.transpose(-1, -2)).mul_(e)  # dL/d(phi_q phi_k^T) inside chunks
        dv1 = w.transpose(-1, -2) @ go
        r = torch.exp(-rho)[..., None]
        dfq = dp @ fk
        dfq += (go @ s.transpose(-1, -2)).mul_(r)
        dfk = dp.transpose(-1, -2) @ fq
        ds = (fq * r).transpose(-1, -2) @ go  # (B,H,nc,D,Dv+1): dL/dS_c from chunk c's queries
        _linear_scan_(ds, decay.clone(), reverse=True)  # total dL/dS_c = dS_c + decay_c * (total dL/dS_(c+1))
        du = torch.zeros_like(ds)
        du[:, :, :-1] = ds[:, :, 1:]  # U_c enters S_(c+1) onwards; the last chunk's U is unused
        dv1 += fki @ du
        dbk = dfk.mul_(fk).addcmul_(v1 @ du.transpose(-1, -2), fki)
        return dfq.mul_(fq), dbk, dv1[..., :-1]


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


def _intra_scale(g: Tensor, rho: Tensor) -> Tensor:
    """e^(g_j - rho_i) for j <= i inside each chunk, else 0: (B,H,nc,C) -> (B,H,nc,C,C)."""
    c = g.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=g.device).tril()
    return torch.exp((g[..., None, :] - rho[..., :, None]).masked_fill(~causal, float("-inf")))


def _lln_causal(aq: Tensor, bk: Tensor, v: Tensor, chunk_size: int) -> Tensor:
    b, h, n, d = aq.shape
    c = min(chunk_size, n)
    nc = -(-n // c)
    pad = nc * c - n
    if pad:
        aq = torch.nn.functional.pad(aq, (0, 0, 0, pad))
        bk = torch.nn.functional.pad(bk, (0, 0, 0, pad), value=float("-inf"))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    aq, bk, v = (t.reshape(b, h, nc, c, t.shape[-1]) for t in (aq, bk, v))
    out = _LLNCausal.apply(aq, bk, v).reshape(b, h, nc * c, -1)
    return out[:, :, :n] if pad else out


@autocast_off
def lln_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """LLN attention in O(N D Dv) time (non-causal) or chunked O(N C D + (N/C) D Dv) (causal).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv); alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1). Causal needs S == N. Half inputs compute in fp32.
    Known limit of the causal form: its shifts (one per query, one per key, none from a future
    token) make q·k products underflow in fp32 when a query's and a key's largest features, above
    about 35 each, sit on different channels (``test_causal_lln_misaligned_extreme_features...``).
    """
    chunk_size = check_positive_int("chunk_size", chunk_size)
    aq, bk, v = _prepare(q, k, v, alpha, beta, key_padding_mask, same_length=causal)
    out = _lln_causal(aq, bk, v, chunk_size) if causal else _lln_noncausal(aq, bk, v)
    return out.to(q.dtype)


def lln_attention_weights(q: Tensor, k: Tensor, alpha, beta, *, causal: bool = False,
                          key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the LLN matrix P_ij = exp(alpha q_i)·exp(beta k_j) / sum_l (the same), masked keys 0 (LLN eq. 8-9).

    q (B,H,N,D), k (B,H,S,D) -> (B,H,R,S) in the compute dtype; alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1); ``rows`` as ``select_rows``; causal needs S == N. Features in float64,
    each query and key shifted by its own max (the query shift cancels in the row normalisation, the
    key shift is added back in log space): a product only underflows when its exponents differ by > ~700.
    """
    check_qkv(q, k, k, same_length=causal)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    index = select_rows(rows, q.shape[2], q.device)
    aq = check_positive_scale("alpha", alpha, q).double() * q[:, :, index].double()
    bk = check_positive_scale("beta", beta, q).double() * k.double()
    key_shift = bk.amax(-1, keepdim=True)
    features = torch.exp(aq - aq.amax(-1, keepdim=True)) @ torch.exp(bk - key_shift).transpose(-1, -2)
    logits = features.clamp_min(torch.finfo(torch.float64).tiny).log() + key_shift.transpose(-1, -2)
    allowed = allowed_keys(index, k.shape[2], causal=causal, key_padding_mask=key_padding_mask)
    return masked_softmax(logits.to(compute_dtype(q)), allowed)


def lln_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """``lln_attention_weights`` @ v: the materialised LLN matrix (LLN eq. 8-9); chunk_size ignored."""
    check_positive_int("chunk_size", chunk_size)
    check_qkv(q, k, v, same_length=causal)
    p = lln_attention_weights(q, k, alpha, beta, causal=causal, key_padding_mask=key_padding_mask)
    return (p @ v.to(p.dtype)).to(q.dtype)


def lln_decode_init(batch: int, heads: int, head_dim: int, value_dim: int, *, dtype=torch.float32, device=None):
    """Empty incremental state: S (B,H,D,Dv+1) = [sum phi_k v^T, sum phi_k] and its per-feature shift (B,H,1,D)."""
    s = torch.zeros(batch, heads, head_dim, value_dim + 1, dtype=dtype, device=device)
    shift = torch.full((batch, heads, 1, head_dim), float("-inf"), dtype=dtype, device=device)
    return s, shift


@autocast_off
def lln_decode_step(q: Tensor, k: Tensor, v: Tensor, alpha, beta, s: Tensor, shift: Tensor,
                    key_padding_mask: Optional[Tensor] = None):
    """One causal step, O(D Dv): q, k (B,H,1,D), v (B,H,1,Dv), state from ``lln_decode_init``.

    Returns (out (B,H,1,Dv), s, shift). The state is kept in fp32 (fp64 for fp64 inputs).
    """
    aq, bk, v = _prepare(q, k, v, alpha, beta, key_padding_mask, same_length=True)
    v1 = _with_ones(v)
    new_shift = torch.maximum(shift, bk)  # running per-feature max, the current key included
    decay = torch.where(torch.isfinite(shift), torch.exp(shift - _finite_or_zero(new_shift)), torch.zeros_like(shift))
    new_shift_f = _finite_or_zero(new_shift)
    s = s * decay.transpose(-1, -2) + torch.exp(bk - new_shift_f).transpose(-1, -2) @ v1
    a = aq + new_shift_f
    fq = torch.exp(a - a.amax(-1, keepdim=True))
    return _divide(fq @ s).to(q.dtype), s, new_shift

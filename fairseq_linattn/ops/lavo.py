"""LAVO: linear attention via orthogonal memory (LAVO §3; the exact definition is docs/design.md §6).

Self-attention output ``0.5 * (F_local + F_global)``:
- ``F_local``: softmax attention inside a window of ``w`` tokens with a learnable relative bias
  ``P`` (H, 2w-1), score ``q_t·k_j/sqrt(D) + P[j - t + w - 1]`` (LAVO §3.2 context dissection,
  §3.3 embedded position encoding). Causal: keys ``t-w+1 .. t``; non-causal: the tokens of the
  query's own window ``[m*w, (m+1)*w)``.
- ``F_global = softmax(q Xtil^T / sqrt(D)) Xtil`` on the orthogonal memory ``Xtil = B ⊙ H``
  (r vectors ``H_i * B_i``), ``H = mean_t (B x_t)`` over the local outputs ``x_t`` of the
  non-padded tokens of earlier windows (causal) or of the whole sequence (non-causal)
  (LAVO §3.1 eq. 3-4). With no such token (causal window 0) the output is ``F_local`` alone.

``bases`` B is (H, r, D) with r <= D (orthonormal rows, see ``lavo_init_bases``); ``v`` must have
the head dim D of ``q`` since the memory lives in value space and is scored against ``q``.
"""
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import (Rows, autocast_off, check_key_padding_mask, check_positive_int, check_qkv, compute_dtype,
                      masked_softmax, select_rows)


def lavo_init_bases(num_heads: int, num_bases: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                    device=None) -> Tensor:
    """(H, r, D) bases, each head ``nn.init.orthogonal_`` (Saxe et al.): rows orthonormal as r <= D."""
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_bases", num_bases)
    check_positive_int("head_dim", head_dim)
    if num_bases > head_dim:
        raise ValueError(f"num_bases must be <= head_dim = {head_dim} (orthogonal rows), got {num_bases}")
    bases = torch.empty(num_heads, num_bases, head_dim, dtype=torch.float32, device=device)
    for head in bases:
        torch.nn.init.orthogonal_(head)
    return bases.to(dtype)


def _check_value_dim(q: Tensor, v: Tensor, v_name: str) -> None:
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"{v_name} must have the head dim D = {q.shape[-1]} of q (the LAVO memory B ⊙ H "
                         f"is compared with q), got Dv = {v.shape[-1]}")


def _check_bases(bases: Tensor, num_heads: int, head_dim: int) -> None:
    if not isinstance(bases, Tensor) or not bases.is_floating_point():
        got = f"dtype {bases.dtype}" if isinstance(bases, Tensor) else type(bases).__name__
        raise ValueError(f"bases must be a floating-point tensor of shape (H, r, D), got {got}")
    if bases.dim() != 3 or bases.shape[0] != num_heads or bases.shape[2] != head_dim or bases.shape[1] < 1:
        raise ValueError(f"bases must have shape (H, r, D) = ({num_heads}, r, {head_dim}), got {tuple(bases.shape)}")
    if bases.shape[1] > head_dim:
        raise ValueError(f"bases must have r <= D = {head_dim} (orthogonal rows), got r = {bases.shape[1]}")


def _check_pos_bias(pos_bias: Tensor, num_heads: int, window: int) -> None:
    expected = (num_heads, 2 * window - 1)
    if not isinstance(pos_bias, Tensor) or not pos_bias.is_floating_point() or tuple(pos_bias.shape) != expected:
        got = tuple(pos_bias.shape) if isinstance(pos_bias, Tensor) else type(pos_bias).__name__
        raise ValueError(f"pos_bias must be a floating-point tensor of shape (H, 2w-1) = {expected} "
                         f"for window w = {window}, got {got}")


def _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask) -> Tuple[int, Optional[Tensor]]:
    check_qkv(q, k, v)
    _check_value_dim(q, v, "v")
    window = check_positive_int("window", window)
    _check_bases(bases, q.shape[1], q.shape[-1])
    _check_pos_bias(pos_bias, q.shape[1], window)
    return window, check_key_padding_mask(key_padding_mask, k)


def _memory_readout(qb: Tensor, mean: Tensor, bases: Tensor, scale: float, out_scale: float = 1.0) -> Tensor:
    """softmax(q Xtil^T * scale) Xtil * out_scale with Xtil_i = mean_i * B_i (LAVO eq. 4), never forming Xtil.

    qb = q B^T (B,H,...,r), mean (broadcastable to qb), bases (H,r,D) -> (B,H,...,D).
    Uses q·Xtil_i = mean_i (q·B_i) and sum_i p_i Xtil_i = (p * mean) B; a zero mean gives 0.
    """
    p = torch.softmax(qb * (mean * scale), -1)
    w = (p * (mean * out_scale)).flatten(2, -2)  # (B,H,M,r)
    out = torch.einsum("bhmr,hrd->bhmd", w, bases)
    return out.view(*qb.shape[:-1], bases.shape[-1])


def _windows(x: Tensor, w: int, causal: bool) -> Tensor:
    """(B,H,nw*w,C) -> keys seen by each window: (B,H,nw,2w,C) previous+own window if causal, else (B,H,nw,w,C)."""
    b, h, n, c = x.shape
    xw = x.view(b, h, n // w, w, c)
    if not causal:
        return xw
    prev = F.pad(xw, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    return torch.cat([prev, xw], dim=3)


def _two_window_views(x: Tensor, w: int) -> Tensor:
    """(F*w, D) rows -> (F-1, 2w, D) overlapping views: entry f-1 holds windows f-1 and f, no copy."""
    rows, d = x.shape
    return x.as_strided((rows // w - 1, 2 * w, d), (w * d, d, 1), x.storage_offset())


class _CausalWindowAttention(torch.autograd.Function):
    """softmax(q k^T + bias) v for each window of w queries against the previous and its own window.

    q, k, v (B,H,nw*w,D) contiguous, q already scaled; bias (H,w,2w) with -inf outside the band.
    Windows are flattened to F = B*H*nw (w, D) blocks, so "previous window" is the previous block
    and [previous, own] is one (2w, D) strided view of k or v: each window is a single (w×D)·(D×2w)
    product, with no copied keys. The blocks that cross a head boundary (every head's window 0) are
    masked; block 0 has no view and is done alone. Saves only the probabilities.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        b, h, n, d = q.shape
        w = bias.shape[1]
        qf = q.view(-1, w, d)
        k2, v2 = k.view(-1, d), v.view(-1, d)
        scores = torch.empty(qf.shape[0], w, 2 * w, dtype=q.dtype, device=q.device)
        if qf.shape[0] > 1:
            torch.bmm(qf[1:], _two_window_views(k2, w).transpose(1, 2), out=scores[1:])
        torch.mm(qf[0], k2[:w].t(), out=scores[0, :, w:])
        per_head = scores.view(b, h, n // w, w, 2 * w)
        per_head.add_(bias[None, :, None])
        per_head[:, :, 0, :, :w] = float("-inf")  # window 0 has no previous window
        p = torch.softmax(scores, -1)
        x = torch.empty_like(qf)
        if qf.shape[0] > 1:
            torch.bmm(p[1:], _two_window_views(v2, w), out=x[1:])
        torch.mm(p[0, :, w:], v2[:w], out=x[0])
        ctx.save_for_backward(qf, k2, v2, p)
        ctx.shape = (b, h, n, d)
        return x.view(b, h, n, d)

    @staticmethod
    def backward(ctx, grad):
        qf, k2, v2, p = ctx.saved_tensors
        b, h, n, d = ctx.shape
        w = p.shape[1]
        g = grad.contiguous().view(-1, w, d)
        many = g.shape[0] > 1
        dp = torch.empty_like(p)
        if many:
            torch.bmm(g[1:], _two_window_views(v2, w).transpose(1, 2), out=dp[1:])
        torch.mm(g[0], v2[:w].t(), out=dp[0, :, w:])
        dp[0, :, :w] = 0  # never computed; its probabilities are 0
        ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
        dq = torch.empty_like(qf)
        if many:
            torch.bmm(ds[1:], _two_window_views(k2, w), out=dq[1:])
        torch.mm(ds[0, :, w:], k2[:w], out=dq[0])
        dk, dv = _window_pair_grad(ds, qf), _window_pair_grad(p, g)
        dbias = ds.view(b, h, n // w, w, 2 * w).sum((0, 2))
        return dq.view(b, h, n, d), dk.view(b, h, n, d), dv.view(b, h, n, d), dbias


def _window_pair_grad(s: Tensor, y: Tensor) -> Tensor:
    """Gradient of the keys (or values) seen through [previous, own] windows: s (F,w,2w), y (F,w,D).

    Window f's keys get s[f, :, w:]^T y[f] (as its own window) + s[f+1, :, :w]^T y[f+1] (as the
    previous window of f+1) -> (F,w,D).
    """
    w = s.shape[1]
    out = torch.bmm(s[:, :, w:].transpose(1, 2), y)
    if s.shape[0] > 1:
        out[:-1].baddbmm_(s[1:, :, :w].transpose(1, 2), y[1:])
    return out


def _local_attention(q: Tensor, k: Tensor, v: Tensor, pos_bias: Tensor, valid: Optional[Tensor], w: int,
                     causal: bool) -> Tensor:
    """F_local (LAVO §3.2-3.3) on (B,H,nw*w,D) inputs, q already scaled by 1/sqrt(D).

    valid (B,nw*w) marks the real keys when some are padding (a query may then have no key at all:
    its output is 0); None when every key a real query can see is real.
    """
    b, h, n, d = q.shape
    nw = n // w
    i = torch.arange(w, device=q.device)[:, None]
    c = torch.arange(2 * w if causal else w, device=q.device)[None, :]
    rel = c - w - i if causal else c - i  # j - t for query slot i, key slot c
    band = (rel <= 0) & (rel > -w) if causal else torch.ones_like(rel, dtype=torch.bool)
    # P[j - t + w - 1] inside the band, -inf outside: one addition applies bias and band, (H,w,keys)
    bias = pos_bias[:, (rel + w - 1).clamp(0, 2 * w - 2)].masked_fill(~band, float("-inf"))
    if valid is None and causal:
        return _CausalWindowAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), bias)
    qw = q.view(b, h, nw, w, d)
    kw, vw = _windows(k, w, causal), _windows(v, w, causal)
    scores = (qw @ kw.transpose(-1, -2)).add_(bias[None, :, None])
    if valid is None:
        return (torch.softmax(scores, -1) @ vw).reshape(b, h, n, d)
    key_valid = _windows(valid[:, None, :, None], w, causal)[:, 0, :, :, 0]  # (B,nw,keys)
    allowed = band & key_valid[:, None, :, None, :]  # (B,1,nw,w,keys)
    has_key = allowed.any(-1, keepdim=True)
    scores.masked_fill_(~(allowed | ~has_key), float("-inf"))  # a keyless row stays finite, zeroed below
    x = (torch.softmax(scores, -1) @ vw).masked_fill(~has_key, 0.0)
    return x.reshape(b, h, n, d)


@autocast_off
def lavo_attention(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *, window: int = 64,
                   causal: bool = True, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """LAVO self-attention in O(N (w + r)) time and memory (no N×N matrix).

    q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D). Causal local attention uses
    blocks of w queries against (previous + own) window with a band mask; the causal memory is an
    exclusive cumulative sum over windows of sum_t B x_t and of the token counts.
    """
    w, key_padding_mask = _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    b, h, n, d = q.shape
    ct = compute_dtype(q)
    nw = -(-n // w)
    pad = nw * w - n
    q_, k_, v_ = (F.pad(t.to(ct), (0, 0, 0, pad)) if pad else t.to(ct) for t in (q, k, v))
    bases_, pos_bias_ = bases.to(ct), pos_bias.to(ct)
    valid = torch.arange(nw * w, device=q.device).expand(b, nw * w) < n
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, pad), value=True)
    q_ = q_ * (1.0 / math.sqrt(d))  # scales the local scores and the memory scores alike

    # padded keys need masking inside windows unless only causal queries past the end could see them
    masked = key_padding_mask is not None or (pad > 0 and not causal)
    x = _local_attention(q_, k_, v_, pos_bias_, valid if masked else None, w, causal)
    tok = valid.to(ct)
    xv = x * tok[:, None, :, None] if pad or key_padding_mask is not None else x  # padded tokens dropped
    qb = torch.einsum("bhnd,hrd->bhnr", q_, bases_)
    r = bases.shape[1]
    # sums of B x_t are only needed per window (causal) or in total: sum the x_t first, then apply B
    # out = 0.5 (F_local + F_global) with memory, F_local without (then the mean is 0 and so is F_global)
    if causal:
        win_sum = torch.einsum("bhmd,hrd->bhmr", xv.view(b, h, nw, w, d).sum(3), bases_)
        win_cnt = tok.view(b, nw, w).sum(2)
        mem_sum = F.pad(win_sum.cumsum(2), (0, 0, 1, 0))[:, :, :-1]  # windows < m
        mem_cnt = F.pad(win_cnt.cumsum(1), (1, 0))[:, :-1]  # (B,nw)
        mean = mem_sum / mem_cnt.clamp_min(1)[:, None, :, None]  # H of eq. 3, (B,H,nw,r)
        half_glob = _memory_readout(qb.view(b, h, nw, w, r), mean[:, :, :, None, :], bases_, 1.0, 0.5)
        coef = torch.where(mem_cnt > 0, 0.5, 1.0).to(ct)[:, None, :, None, None]
        out = torch.addcmul(half_glob, x.view(b, h, nw, w, d), coef).view(b, h, nw * w, d)
    else:
        cnt = tok.sum(1)  # (B,)
        mean = torch.einsum("bhd,hrd->bhr", xv.sum(2), bases_) / cnt.clamp_min(1)[:, None, None]  # (B,H,r)
        half_glob = _memory_readout(qb, mean[:, :, None, :], bases_, 1.0, 0.5)
        out = torch.addcmul(half_glob, x, torch.where(cnt > 0, 0.5, 1.0).to(ct)[:, None, None, None])
    return (out[:, :, :n] if pad else out).to(q.dtype)


def lavo_token_mixing(q: Tensor, k: Tensor, pos_bias: Tensor, *, window: int = 64, causal: bool = True,
                      key_padding_mask: Optional[Tensor] = None, rows: Rows = None
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """LAVO's token mixing for query rows ``rows`` (``select_rows``): the local matrix A, the memory mean m.

    q, k (B,H,N,D), pos_bias (H,2w-1) -> A (B,H,R,N), m (B,H,R,N), has_memory (B,R) bool, in the compute dtype.
    A_t: the local window softmax with its relative bias (LAVO §3.2-3.3); m_t: the mean of the rows A_j
    over t's memory tokens j, the non-padded tokens of earlier windows if causal, all if not (eq. 3).
    The output is 0.5 A_t V + 0.5 Pi_t (m_t V) with Pi_t = sum_i p_ti B_i B_i^T (p_t the memory softmax
    of eq. 4), A_t V without memory (see ``lavo_attention_reference``). O(R N + N²/w) memory.
    """
    check_qkv(q, k, k)
    w = check_positive_int("window", window)
    _check_pos_bias(pos_bias, q.shape[1], w)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    b, h, n, d = q.shape
    ct = compute_dtype(q)
    q, k, pos_bias = q.to(ct), k.to(ct), pos_bias.to(ct)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    j = torch.arange(n, device=q.device)

    def local_rows(idx: Tensor) -> Tensor:
        t = idx[:, None]
        # causal: keys t-w+1..t; non-causal: the query's window; score q·k/sqrt(D) + P[j - t + w - 1]
        local = (j <= t) & (j > t - w) if causal else (j // w) == (t // w)
        scores = q[:, :, idx] @ k.transpose(-1, -2) / math.sqrt(d) + pos_bias[:, (j - t + w - 1).clamp(0, 2 * w - 2)]
        return masked_softmax(scores, local[None, None] & valid[:, None, None, :])

    nw = -(-n // w)
    window_sums = torch.zeros(b, h, nw, n, dtype=ct, device=q.device)  # sum of A's rows over each window's real tokens
    for m in range(nw):
        idx = j[m * w:(m + 1) * w]
        window_sums[:, :, m] = (local_rows(idx) * valid[:, None, idx, None]).sum(2)
    window_counts = F.pad(valid.to(ct), (0, nw * w - n)).view(b, nw, w).sum(2)  # (B,nw)
    index = select_rows(rows, n, q.device)
    if causal:  # windows < m (LAVO eq. 3)
        mem_sum = (window_sums.cumsum(2) - window_sums)[:, :, index // w]
        mem_cnt = (window_counts.cumsum(1) - window_counts)[:, index // w]
    else:
        mem_sum = window_sums.sum(2, keepdim=True).expand(-1, -1, len(index), -1)
        mem_cnt = window_counts.sum(1, keepdim=True).expand(-1, len(index))
    memory = mem_sum / mem_cnt.clamp_min(1)[:, None, :, None]
    return local_rows(index), memory, mem_cnt > 0


def lavo_attention_weights(q: Tensor, k: Tensor, pos_bias: Tensor, *, window: int = 64, causal: bool = True,
                           key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Row-stochastic token mixing P_t = 0.5 A_t + 0.5 m_t (A_t without memory) of ``lavo_token_mixing``.

    (B,H,R,N). P says which tokens a query reads; P V is not the output (the memory read-out also
    projects the values per query, Pi_t).
    """
    local, memory, has_memory = lavo_token_mixing(q, k, pos_bias, window=window, causal=causal,
                                                  key_padding_mask=key_padding_mask, rows=rows)
    return torch.where(has_memory[:, None, :, None], 0.5 * (local + memory), local)


def lavo_attention_reference(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *,
                             window: int = 64, causal: bool = True,
                             key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """docs/design.md §6 materialised from ``lavo_token_mixing``: N×N A and m, memory Xtil (B,H,N,r,D)."""
    w, key_padding_mask = _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    local, memory, has_memory = lavo_token_mixing(q, k, pos_bias, window=w, causal=causal,
                                                  key_padding_mask=key_padding_mask)
    ct = local.dtype
    q, v, bases = q.to(ct), v.to(ct), bases.to(ct)
    x = local @ v  # F_local (LAVO §3.2-3.3); a query with no allowed key gets 0
    mean = torch.einsum("bhtd,hrd->bhtr", memory @ v, bases)  # H_t = mean of B x_j over t's memory tokens (eq. 3)
    xtil = mean[..., None] * bases[None, :, None]  # Xtil = B ⊙ H, (B,H,N,r,D)
    p = torch.softmax(torch.einsum("bhtd,bhtrd->bhtr", q, xtil) / math.sqrt(q.shape[-1]), -1)  # eq. 4
    glob = torch.einsum("bhtr,bhtrd->bhtd", p, xtil)
    return torch.where(has_memory[:, None, :, None], 0.5 * (x + glob), x)


def _check_cross(q, k_src, v_src, bases, key_padding_mask) -> Optional[Tensor]:
    check_qkv(q, k_src, v_src, same_length=False)
    _check_value_dim(q, v_src, "v_src")
    _check_bases(bases, q.shape[1], q.shape[-1])
    return check_key_padding_mask(key_padding_mask, k_src)


@autocast_off
def lavo_cross_memory(v_src: Tensor, bases: Tensor, *, key_padding_mask: Optional[Tensor] = None
                      ) -> Tuple[Tensor, Tensor]:
    """The source memory of LAVO cross-attention: H = mean_j (B v_j) over non-padded j (LAVO eq. 3).

    v_src (B,H,S,D), bases (H,r,D) -> (mean (B,H,r), count (B,)) in the compute dtype (fp32 for half
    inputs). All a decoder needs of the source: ``lavo_cross_readout`` answers any query from it. O(S r D).
    """
    check_qkv(v_src, v_src, v_src)
    _check_bases(bases, v_src.shape[1], v_src.shape[-1])
    key_padding_mask = check_key_padding_mask(key_padding_mask, v_src)
    ct = compute_dtype(v_src)
    tok = torch.ones(v_src.shape[0], v_src.shape[2], dtype=ct, device=v_src.device)
    if key_padding_mask is not None:
        tok = (~key_padding_mask).to(ct)
    cnt = tok.sum(1)
    bv = torch.einsum("bhsd,hrd->bhsr", v_src.to(ct), bases.to(ct)) * tok[:, None, :, None]
    return bv.sum(2) / cnt.clamp_min(1)[:, None, None], cnt


@autocast_off
def lavo_cross_readout(q: Tensor, mean: Tensor, count: Tensor, bases: Tensor) -> Tensor:
    """softmax(Q Xtil^T/sqrt(D)) Xtil with Xtil = B ⊙ mean (LAVO eq. 4): q (B,H,N,D) -> (B,H,N,D).

    ``mean``, ``count`` from ``lavo_cross_memory``; a row with no source token (count 0) gives 0. O(N r D).
    """
    b, h, _, d = q.shape
    _check_bases(bases, h, d)
    if tuple(mean.shape) != (b, h, bases.shape[1]) or tuple(count.shape) != (b,):
        raise ValueError(f"mean and count must have shapes (B, H, r) = {(b, h, bases.shape[1])} and (B,) = {(b,)} "
                         f"(from lavo_cross_memory), got {tuple(mean.shape)} and {tuple(count.shape)}")
    ct = mean.dtype
    qb = torch.einsum("bhnd,hrd->bhnr", q.to(ct), bases.to(ct))
    out = _memory_readout(qb, mean[:, :, None, :], bases.to(ct), 1.0 / math.sqrt(d))
    return (out * (count > 0).to(ct)[:, None, None, None]).to(q.dtype)


def lavo_cross_attention(q: Tensor, k_src: Tensor, v_src: Tensor, bases: Tensor, *,
                         key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """LAVO cross-attention (§3.4): softmax(Q Xtil^T/sqrt(D)) Xtil, Xtil = B ⊙ mean_j(B v_j), no local part.

    q (B,H,N,D), k_src (B,H,S,D), v_src (B,H,S,D), bases (H,r,D) -> (B,H,N,D). CODE uses the
    source *values* only (LAVO §3.4); k_src is checked for shape but does not enter the output.
    Padded source tokens are left out of the mean; with no source token the output is 0. O((N+S) r D).
    """
    key_padding_mask = _check_cross(q, k_src, v_src, bases, key_padding_mask)
    mean, count = lavo_cross_memory(v_src, bases, key_padding_mask=key_padding_mask)
    return lavo_cross_readout(q, mean, count, bases)


def lavo_cross_attention_reference(q: Tensor, k_src: Tensor, v_src: Tensor, bases: Tensor, *,
                                   key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Materialises Xtil (B,H,r,D) = H_i * B_i with H = mean over non-padded source of B v_j."""
    key_padding_mask = _check_cross(q, k_src, v_src, bases, key_padding_mask)
    ct = compute_dtype(q)
    q, v, bases = q.to(ct), v_src.to(ct), bases.to(ct)
    keep = torch.ones(v.shape[0], v.shape[2], dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        keep = ~key_padding_mask
    out = torch.zeros_like(q)
    for bi in range(q.shape[0]):
        if not keep[bi].any():
            continue  # no source token: no memory, output 0
        code = torch.einsum("hsd,hrd->hsr", v[bi][:, keep[bi]], bases).mean(1)  # H (eq. 3), (H,r)
        xtil = code[..., None] * bases  # (H,r,D)
        p = torch.softmax(q[bi] @ xtil.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)  # eq. 4
        out[bi] = p @ xtil
    return out


def lavo_init_state(batch_size: int, num_heads: int, head_dim: int, num_bases: int, *, window: int,
                    dtype: torch.dtype = torch.float32, device=None) -> Dict[str, Tensor]:
    """Empty decoding state for ``lavo_decode_step`` (half dtypes are kept in float32).

    - ``prev_key``, ``prev_value`` (B,H,w-1,D): the last w-1 keys/values
    - ``prev_key_padding_mask`` (B,w-1) bool: True where that slot holds no real token (padding, or
      before the start)
    - ``mem_sum`` (B,H,r), ``mem_count`` (B,): sum of B x_t over the real tokens of completed windows
      and their number
    - ``window_sum`` (B,H,r), ``window_count`` (B,): the same over the current window's real tokens so far
    - ``position`` (B,) long: index t of the next real token (padded tokens are skipped)
    Every tensor has the batch on dim 0, so beam reordering is
    ``{name: t.index_select(0, new_order) for name, t in state.items()}``.
    """
    window = check_positive_int("window", window)
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    kv = dict(dtype=dtype, device=device)
    return {
        "prev_key": torch.zeros(batch_size, num_heads, window - 1, head_dim, **kv),
        "prev_value": torch.zeros(batch_size, num_heads, window - 1, head_dim, **kv),
        "prev_key_padding_mask": torch.ones(batch_size, window - 1, dtype=torch.bool, device=device),
        "mem_sum": torch.zeros(batch_size, num_heads, num_bases, **kv),
        "mem_count": torch.zeros(batch_size, **kv),
        "window_sum": torch.zeros(batch_size, num_heads, num_bases, **kv),
        "window_count": torch.zeros(batch_size, **kv),
        "position": torch.zeros(batch_size, dtype=torch.long, device=device),
    }


@autocast_off
def lavo_decode_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, bases: Tensor, pos_bias: Tensor,
                     state: Dict[str, Tensor], *, window: int, key_padding_mask: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One causal LAVO token: q_t, k_t, v_t (B,H,1,D) -> (out (B,H,1,D), new_state); O(w D + r D).

    ``key_padding_mask`` (B,1), True where this token is padding (None: all real): a padded token
    leaves its row's state as it was (it enters no window and no memory, and counts no position), so
    real tokens count positions among themselves. Equals ``lavo_attention(..., causal=True)`` at
    position ``state["position"]`` of the row's real tokens alone.
    """
    w, key_padding_mask = _check_lavo(q_t, k_t, v_t, bases, pos_bias, window, key_padding_mask)
    b, h, n, d = q_t.shape
    if n != 1:
        raise ValueError(f"q_t, k_t, v_t must hold one token, shape (B, H, 1, D), got {tuple(q_t.shape)}")
    if tuple(state["prev_key"].shape) != (b, h, w - 1, d):
        raise ValueError(f"state['prev_key'] must have shape (B, H, w-1, D) = {(b, h, w - 1, d)}, "
                         f"got {tuple(state['prev_key'].shape)} (was the state made with this window?)")
    ct = state["mem_sum"].dtype
    q, k, v, bases_, pos_bias_ = (x.to(ct) for x in (q_t, k_t, v_t, bases, pos_bias))
    pad = torch.zeros(b, 1, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    pos = state["position"]
    keys = torch.cat([state["prev_key"], k], dim=2)  # positions t-w+1 .. t
    values = torch.cat([state["prev_value"], v], dim=2)
    key_pad = torch.cat([state["prev_key_padding_mask"], pad], dim=1)  # (B,w)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(d) + pos_bias_[:, None, :w]  # P[j - t + w - 1] = P[c]
    x = masked_softmax(scores, ~key_pad[:, None, None, :]) @ values  # F_local,t
    mem_count = state["mem_count"]
    mean = state["mem_sum"] / mem_count.clamp_min(1)[:, None, None]
    qb = torch.einsum("bhnd,hrd->bhnr", q, bases_)
    glob = _memory_readout(qb, mean[:, :, None, :], bases_, 1.0 / math.sqrt(d))
    out = torch.where((mem_count > 0)[:, None, None, None], 0.5 * (x + glob), x)

    window_sum = state["window_sum"] + torch.einsum("bhd,hrd->bhr", x[:, :, 0], bases_)  # LAVO eq. 3
    window_count = state["window_count"] + 1
    ends = (pos + 1) % w == 0  # this token completes its window: fold it into memory
    new_state = {
        "prev_key": keys[:, :, 1:],
        "prev_value": values[:, :, 1:],
        "prev_key_padding_mask": key_pad[:, 1:],
        "mem_sum": torch.where(ends[:, None, None], state["mem_sum"] + window_sum, state["mem_sum"]),
        "mem_count": torch.where(ends, mem_count + window_count, mem_count),
        "window_sum": torch.where(ends[:, None, None], torch.zeros_like(window_sum), window_sum),
        "window_count": torch.where(ends, torch.zeros_like(window_count), window_count),
        "position": pos + 1,
    }
    kept = pad[:, 0]  # a padded token: the row's state stays as it was
    new_state = {name: torch.where(kept.view(-1, *[1] * (t.dim() - 1)), state[name], t) for name, t in new_state.items()}
    return out.to(q_t.dtype), new_state

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


_WORK_ELEMENTS = 1 << 20  # values in one (B,H,rows,D) working temporary
_MIN_PASSES = 16  # so that a pass's temporaries stay a small fraction of an (N, D) tensor


def _span(x: Tensor, w: int, r0: int, r1: int) -> Tensor:
    """Rows [r0, r1) of x (B,H,N,C) as windows (B,H,(r1-r0)/w,w,C); zero rows outside [0, N)."""
    lo, hi = max(r0, 0), min(r1, x.shape[2])
    part = x[:, :, lo:hi]
    if lo > r0 or hi < r1:
        part = F.pad(part, (0, 0, lo - r0, r1 - hi))
    return part.unflatten(2, (-1, w))


def _keys_seen(x: Tensor, w: int, f0: int, f1: int, causal: bool) -> Tensor:
    """Keys (or values) seen by windows [f0, f1): (B,H,G,2w,C) previous+own window if causal, else (B,H,G,w,C)."""
    if not causal:
        return _span(x, w, f0 * w, f1 * w)
    both = _span(x, w, (f0 - 1) * w, f1 * w)
    return torch.cat([both[:, :, :-1], both[:, :, 1:]], 3)


def _add_to_windows(dst: Tensor, grad: Tensor, w: int, f0: int, f1: int, causal: bool) -> None:
    """dst (B,H,N,C) += the gradient of the keys seen by windows [f0, f1), grad as from ``_keys_seen``."""
    n = dst.shape[2]
    parts = [(grad[:, :, :, w:] if causal else grad, f0)]
    if causal:
        parts.append((grad[:, :, :, :w], f0 - 1))
    for g, start in parts:
        rows = g.flatten(2, 3)
        lo = max(start * w, 0)
        hi = min(start * w + rows.shape[2], n)
        if hi > lo:
            dst[:, :, lo:hi] += rows[:, :, lo - start * w:hi - start * w]


def _local_probs(q, k, bias, valid, w, f0, f1, causal, scale):
    """Window softmax of windows [f0, f1) (LAVO §3.2-3.3): (p (B,H,G,w,K), has_key (B,1,G,w,1) or None, q*scale)."""
    qs = _span(q, w, f0 * w, f1 * w) * scale
    scores = (qs @ _keys_seen(k, w, f0, f1, causal).transpose(-1, -2)).add_(bias[None, :, None])
    if causal and f0 == 0:
        scores[:, :, 0, :, :w] = float("-inf")  # window 0 has no previous window
    has_key = None
    if valid is not None:
        key_valid = _keys_seen(valid[:, None, :, None], w, f0, f1, causal)[:, 0, :, :, 0]  # (B,G,K)
        allowed = torch.isfinite(bias[None, :1, None]) & key_valid[:, None, :, None, :]  # (B,1,G,w,K)
        has_key = allowed.any(-1, keepdim=True)
        scores.masked_fill_(~(allowed | ~has_key), float("-inf"))  # a keyless row stays finite, zeroed after
    return torch.softmax(scores, -1), has_key, qs


def _memory_probs(qs, bases, mean):
    """qb = q B^T and p = softmax(qb * H) (LAVO eq. 4 with q·Xtil_i = H_i (q·B_i)), (B,H,G,w,r) each."""
    qb = torch.einsum("bhgwd,hrd->bhgwr", qs, bases)
    return qb, torch.softmax(qb * mean, -1)


class _LAVO(torch.autograd.Function):
    """LAVO self-attention 0.5 (F_local + F_global) with a hand-written backward.

    q, k, v (B,H,N,D) compute dtype (unscaled), bases (H,r,D), bias (H,w,K) with -inf outside the band
    (K = 2w causal, w otherwise), valid (B,nw*w) real tokens or None when no key needs masking,
    tok (B,nw*w) the tokens of the memory. Windows are processed in groups of working size: pass 1
    writes F_local into the output buffer and sums it per window, pass 2 adds the memory read-out in
    place. Saves only the per-window sums and means (B,H,nw,·); the backward recomputes the window
    probabilities and the memory probabilities group by group.
    """

    @staticmethod
    def forward(ctx, q, k, v, bases, bias, valid, tok, causal: bool):
        b, h, n, d = q.shape
        w = bias.shape[1]
        nw = tok.shape[1] // w
        scale = 1.0 / math.sqrt(d)
        per = max(1, min(_WORK_ELEMENTS // (b * h * d * w), nw // _MIN_PASSES))
        groups = [(f0, min(f0 + per, nw)) for f0 in range(0, nw, per)]
        out = q.new_empty(b, h, n, d)
        win = q.new_empty(b, h, nw, d)  # sum of x_t over the memory tokens of each window
        tokw = tok.view(b, nw, w)
        for f0, f1 in groups:  # pass 1: F_local
            p, has_key, _ = _local_probs(q, k, bias, valid, w, f0, f1, causal, scale)
            x = p @ _keys_seen(v, w, f0, f1, causal)
            if has_key is not None:
                x.masked_fill_(~has_key, 0.0)
            win[:, :, f0:f1] = torch.einsum("bhgwd,bgw->bhgd", x, tokw[:, f0:f1])
            xf = x.flatten(2, 3)[:, :, :n - f0 * w]
            out[:, :, f0 * w:f0 * w + xf.shape[2]] = xf
        mean, coef, wsum = _memory_mean(win, bases, tokw, causal)
        for f0, f1 in groups:  # pass 2: out = coef F_local + 0.5 F_global
            qs = _span(q, w, f0 * w, f1 * w) * scale
            m = _group_mean(mean, f0, f1, causal)
            _, pm = _memory_probs(qs, bases, m)
            glob = torch.einsum("bhgwr,hrd->bhgwd", pm.mul_(m * 0.5), bases).flatten(2, 3)[:, :, :n - f0 * w]
            rows = out[:, :, f0 * w:f0 * w + glob.shape[2]]
            rows.mul_(_group_coef(coef, f0, f1, w, glob.shape[2], causal)).add_(glob)
        ctx.save_for_backward(q, k, v, bases, bias, valid, tok, wsum, mean, coef)
        ctx.causal, ctx.groups = causal, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bases, bias, valid, tok, wsum, mean, coef = ctx.saved_tensors
        causal, groups = ctx.causal, ctx.groups
        b, h, n, d = q.shape
        w = bias.shape[1]
        nw = tok.shape[1] // w
        scale = 1.0 / math.sqrt(d)
        tokw = tok.view(b, nw, w)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dbases, dbias = torch.zeros_like(bases), torch.zeros_like(bias)
        dmean = torch.zeros_like(mean)
        for f0, f1 in groups:  # pass A: F_global = (p ⊙ H) B with p = softmax(qb ⊙ H) (eq. 4)
            gg = _span(grad, w, f0 * w, f1 * w)
            qs = _span(q, w, f0 * w, f1 * w) * scale
            m = _group_mean(mean, f0, f1, causal)
            qb, pm = _memory_probs(qs, bases, m)
            dwgt = torch.einsum("bhgwd,hrd->bhgwr", gg, bases).mul_(0.5)  # dL/d(p ⊙ H)
            dbases += torch.einsum("bhgwr,bhgwd->hrd", pm * m * 0.5, gg)
            dp = dwgt * m
            dlog = dp.sub_((dp * pm).sum(-1, keepdim=True)).mul_(pm)  # softmax backward
            dm = (dwgt * pm).add_(dlog * qb)
            _group_mean_grad(dmean, dm, f0, f1, causal)
            dqb = dlog.mul_(m)
            dbases += torch.einsum("bhgwr,bhgwd->hrd", dqb, qs)
            dqs = torch.einsum("bhgwr,hrd->bhgwd", dqb, bases).flatten(2, 3)[:, :, :n - f0 * w]
            torch.mul(dqs, scale, out=dq[:, :, f0 * w:f0 * w + dqs.shape[2]])
        dwin = _memory_mean_grad(dmean, wsum, bases, dbases, tokw, causal)  # dL/d(window sums of x)
        for f0, f1 in groups:  # pass B: F_local
            p, has_key, qs = _local_probs(q, k, bias, valid, w, f0, f1, causal, scale)
            dx = _span(grad, w, f0 * w, f1 * w) * _group_coef(coef, f0, f1, w, None, causal)
            dx += (dwin[:, :, f0:f1, None] if causal else dwin[:, :, None, None]) * tokw[:, None, f0:f1, :, None]
            if has_key is not None:
                dx.masked_fill_(~has_key, 0.0)
            _add_to_windows(dv, p.transpose(-1, -2) @ dx, w, f0, f1, causal)
            dp = dx @ _keys_seen(v, w, f0, f1, causal).transpose(-1, -2)
            ds = dp.sub_((dp * p).sum(-1, keepdim=True)).mul_(p)  # softmax backward
            dbias += ds.sum((0, 2))
            _add_to_windows(dk, ds.transpose(-1, -2) @ qs, w, f0, f1, causal)
            dqs = (ds @ _keys_seen(k, w, f0, f1, causal)).flatten(2, 3)[:, :, :n - f0 * w]
            dq[:, :, f0 * w:f0 * w + dqs.shape[2]].add_(dqs, alpha=scale)
        return dq, dk, dv, dbases, dbias, None, None, None


def _memory_mean(win: Tensor, bases: Tensor, tokw: Tensor, causal: bool):
    """H = mean of B x_t over the memory tokens (LAVO eq. 3): (mean, coef of F_local, window sums B·x).

    causal: per window over the windows before it, mean (B,H,nw,r), coef (B,nw); else mean (B,H,r), coef (B,).
    """
    wsum = torch.einsum("bhmd,hrd->bhmr", win, bases)
    cnt = tokw.sum(2)  # (B,nw)
    if causal:
        mem = F.pad(wsum.cumsum(2), (0, 0, 1, 0))[:, :, :-1]  # windows < m
        mem_cnt = F.pad(cnt.cumsum(1), (1, 0))[:, :-1]
        mean = mem / mem_cnt.clamp_min(1)[:, None, :, None]
        return mean, torch.where(mem_cnt > 0, 0.5, 1.0).to(win.dtype), win
    total = cnt.sum(1)
    return wsum.sum(2) / total.clamp_min(1)[:, None, None], torch.where(total > 0, 0.5, 1.0).to(win.dtype), win


def _memory_mean_grad(dmean: Tensor, win: Tensor, bases: Tensor, dbases: Tensor, tokw: Tensor, causal: bool):
    """dL/d(per-window sums of x) (B,H,nw,D) causal or (B,H,D), from dL/dH; adds the bases' share to dbases."""
    cnt = tokw.sum(2)
    if causal:
        mem_cnt = F.pad(cnt.cumsum(1), (1, 0))[:, :-1]
        dmem = dmean / mem_cnt.clamp_min(1)[:, None, :, None]
        # window m's sum enters the memory of every later window: a reverse exclusive cumulative sum
        dws = F.pad(dmem.flip(2).cumsum(2).flip(2), (0, 0, 0, 1))[:, :, 1:]
        dbases += torch.einsum("bhmr,bhmd->hrd", dws, win)
        return torch.einsum("bhmr,hrd->bhmd", dws, bases)
    dws = dmean / cnt.sum(1).clamp_min(1)[:, None, None]
    dbases += torch.einsum("bhr,bhd->hrd", dws, win.sum(2))
    return torch.einsum("bhr,hrd->bhd", dws, bases)


def _group_mean(mean: Tensor, f0: int, f1: int, causal: bool) -> Tensor:
    return mean[:, :, f0:f1, None, :] if causal else mean[:, :, None, None, :]


def _group_mean_grad(dmean: Tensor, dm: Tensor, f0: int, f1: int, causal: bool) -> None:
    if causal:
        dmean[:, :, f0:f1] += dm.sum(3)
    else:
        dmean += dm.sum((2, 3))


def _group_coef(coef: Tensor, f0: int, f1: int, w: int, rows: Optional[int], causal: bool) -> Tensor:
    """The weight of F_local in the output, for windows [f0, f1): (B,1,G,1,1) or, given rows, (B,1,rows,1)."""
    c = coef[:, f0:f1] if causal else coef[:, None].expand(-1, f1 - f0)
    c = c[:, None, :, None, None].expand(-1, -1, -1, w, -1)
    return c if rows is None else c.flatten(2, 3)[:, :, :rows]


def _band_bias(pos_bias: Tensor, w: int, causal: bool) -> Tensor:
    """(H,w,K): P[j - t + w - 1] for query slot t, key slot j inside the band, -inf outside (LAVO §3.3).

    Causal keys are [previous, own] window (K = 2w, offsets -w+1 .. 0); otherwise the own window (K = w).
    """
    i = torch.arange(w, device=pos_bias.device)[:, None]
    c = torch.arange(2 * w if causal else w, device=pos_bias.device)[None, :]
    rel = c - w - i if causal else c - i  # j - t
    band = (rel <= 0) & (rel > -w) if causal else torch.ones_like(rel, dtype=torch.bool)
    return pos_bias[:, (rel + w - 1).clamp(0, 2 * w - 2)].masked_fill(~band, float("-inf"))


@autocast_off
def lavo_attention(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *, window: int = 64,
                   causal: bool = True, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """LAVO self-attention in O(N (w + r)) time and memory (no N×N matrix).

    q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D). Causal local attention uses
    blocks of w queries against (previous + own) window with a band mask; the causal memory is an
    exclusive cumulative sum over windows of sum_t B x_t and of the token counts. Beyond the inputs it
    holds the output, the gradients and working-size temporaries (see ``_LAVO``).
    """
    w, key_padding_mask = _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    b, n = q.shape[0], q.shape[2]
    ct = compute_dtype(q)
    nw = -(-n // w)
    pad = nw * w - n
    valid = torch.arange(nw * w, device=q.device).expand(b, nw * w) < n
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, pad), value=True)
    # padded keys need masking inside windows unless only causal queries past the end could see them
    masked = key_padding_mask is not None or (pad > 0 and not causal)
    out = _LAVO.apply(q.to(ct), k.to(ct), v.to(ct), bases.to(ct), _band_bias(pos_bias.to(ct), w, causal),
                      valid if masked else None, valid.to(ct), causal)
    return out.to(q.dtype)


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

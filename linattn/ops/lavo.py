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
from ._windows import (Group, bmm_rows, flat_heads, group_rows, rows_view, scaled_bmm, store_rows, window_groups,
                       window_pairs)


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


_WORK_ELEMENTS = 1 << 20  # values in one (rows, D) working temporary


class _Layout:
    """What every pass of ``_LAVO`` reads: the inputs with heads flattened (B·H, N, ·), per-head parameters
    repeated over the batch, the window groups (``_windows``), and the window softmax of a group."""

    def __init__(self, q, k, v, bases, bias, valid, tok, causal: bool):
        b, h, _, d = q.shape
        self.w, self.causal, self.scale = bias.shape[1], causal, 1.0 / math.sqrt(d)
        self.q, self.k, self.v = flat_heads(q), flat_heads(k), flat_heads(v)
        self.bases, self.bias = bases.repeat(b, 1, 1), bias.repeat(b, 1, 1)  # (B·H, r, D), (B·H, w, K)
        self.valid = None if valid is None else valid.repeat_interleave(h, 0)[..., None]  # (B·H, nw*w, 1)
        self.tok = tok.repeat_interleave(h, 0)[..., None]
        self.groups = window_groups(b * h, q.shape[2], self.w, d, _WORK_ELEMENTS)

    def seen(self, x3: Tensor, g: Group, fill=0) -> Tensor:
        """Keys (values, valid flags) seen by the windows of g: (F,2w,C) [previous, own] window if causal, else (F,w,C)."""
        rows = group_rows(x3, g, self.w, context=self.causal, fill=fill)
        return window_pairs(rows) if self.causal else rows

    def local_probs(self, g: Group):
        """Window softmax of g (LAVO §3.2-3.3): p (F,w,K), has_key (F,w,1) or None, the queries (F,w,D) unscaled
        and the keys seen (F,K,D)."""
        w = self.w
        qw, ks = group_rows(self.q, g, w), self.seen(self.k, g)
        scores = scaled_bmm(qw, ks.transpose(1, 2), self.scale)
        per_head = scores.view(g.heads, g.windows, w, -1)
        per_head.add_(self.bias[g.h0:g.h1, None])
        if self.causal and g.f0 == 0:
            per_head[:, 0, :, :w] = float("-inf")  # a head's window 0 has no previous window
        has_key = None
        if self.valid is not None:
            key_valid = self.seen(self.valid, g, fill=False).reshape(g.heads, g.windows, 1, -1)
            allowed = torch.isfinite(self.bias[g.h0:g.h1, None]) & key_valid  # (h,G,w,K)
            if self.causal and g.f0 == 0:
                allowed[:, 0, :, :w] = False
            has_key = allowed.any(-1, keepdim=True)
            per_head.masked_fill_(~(allowed | ~has_key), float("-inf"))  # a keyless row stays finite, zeroed after
            has_key = has_key.view(-1, w, 1)
        return torch.softmax(scores, -1), has_key, qw, ks

    def memory_probs(self, qw: Tensor, g: Group, mean: Tensor):
        """qb = q B^T / sqrt(D) and p = softmax(qb * H) (LAVO eq. 4 with q·Xtil_i = H_i (q·B_i)), (h,G,w,r) each."""
        qb = scaled_bmm(qw.view(g.heads, -1, qw.shape[-1]), self.bases[g.h0:g.h1].transpose(1, 2), self.scale)
        qb = qb.view(g.heads, g.windows, self.w, -1)
        return qb, torch.softmax(qb * mean, -1)

    def per_window(self, x: Tensor, g: Group) -> Tensor:
        """Rows of g of a per-window (B·H, nw, ·) tensor, or of a per-head (B·H, 1, ·) one: (h,G|1,1,·)."""
        return (x[g.h0:g.h1, g.f0:g.f1] if self.causal else x[g.h0:g.h1])[:, :, None]

    def add_seen_grad(self, dst3: Tensor, g: Group, s: Tensor, y: Tensor, alpha: float = 1.0) -> None:
        """dst3's rows of the keys (or values) seen by g <- alpha s^T y, s (F,w,K) as from ``local_probs``, y (F,w,C).

        Causal: window f gets its own half of s[f] and the previous half of s[f+1]; group g's first window's
        previous half goes to window f0 - 1, already written by the group before. Between whole heads the
        previous half of a head's window 0 meets the head before; its weights are exactly 0 there.
        """
        w = self.w
        if not self.causal:
            bmm_rows(dst3, g, w, s.transpose(1, 2), y, alpha=alpha)
            return
        view = rows_view(dst3, g, w)
        own = scaled_bmm(s[:, :, w:].transpose(1, 2), y, alpha, out=view)
        own[:-1].baddbmm_(s[1:, :, :w].transpose(1, 2), y[1:], alpha=alpha)
        if view is None:
            store_rows(dst3, g, w, own)
        if g.f0 > 0:
            dst3[g.h0, (g.f0 - 1) * w:g.f0 * w].addmm_(s[0, :, :w].t(), y[0], alpha=alpha)


class _LAVO(torch.autograd.Function):
    """LAVO self-attention 0.5 (F_local + F_global) with a hand-written backward.

    q, k, v (B,H,N,D) compute dtype (unscaled), bases (H,r,D), bias (H,w,K) with -inf outside the band
    (K = 2w causal, w otherwise), valid (B,nw*w) real tokens or None when no key needs masking,
    tok (B,nw*w) the tokens of the memory. Windows are processed in groups of working size (``_Layout``):
    pass 1 writes F_local into the output buffer and sums it per window, pass 2 adds the memory read-out
    in place. Saves only the per-window sums and means (B,H,nw,·); the backward recomputes the window
    probabilities and the memory probabilities group by group.
    """

    @staticmethod
    def forward(ctx, q, k, v, bases, bias, valid, tok, causal: bool):
        b, h, n, d = q.shape
        lay = _Layout(q, k, v, bases, bias, valid, tok, causal)
        w = lay.w
        nw = tok.shape[1] // w
        out = q.new_empty(b, h, n, d)
        out3 = flat_heads(out)
        win = q.new_empty(b * h, nw, d)  # sum of x_t over the memory tokens of each window
        for g in lay.groups:  # pass 1: F_local
            p, has_key, _, _ = lay.local_probs(g)
            x = torch.bmm(p, lay.seen(lay.v, g))
            if has_key is not None:
                x.masked_fill_(~has_key, 0.0)
            tokr = group_rows(lay.tok, g, w)  # (F,w,1)
            torch.bmm(tokr.transpose(1, 2), x, out=win[g.h0:g.h1, g.f0:g.f1].view(-1, 1, d))
            store_rows(out3, g, w, x)
        mean, coef, wsum = _memory_mean(win.view(b, h, nw, d), bases, tok.view(b, nw, w), causal)
        mean3, coef3 = mean.reshape(b * h, -1, bases.shape[1]), coef.repeat_interleave(h, 0).view(b * h, -1, 1)
        for g in lay.groups:  # pass 2: out = coef F_local + 0.5 F_global
            m = lay.per_window(mean3, g)
            _, pm = lay.memory_probs(group_rows(lay.q, g, w), g, m)
            glob = torch.bmm(pm.mul_(m * 0.5).view(g.heads, -1, pm.shape[-1]), lay.bases[g.h0:g.h1])
            rows = rows_view(out3, g, w)
            x = group_rows(out3, g, w) if rows is None else rows
            x.view(g.heads, g.windows, w, d).mul_(lay.per_window(coef3, g)).add_(glob.view(g.heads, g.windows, w, d))
            if rows is None:
                store_rows(out3, g, w, x)
        ctx.save_for_backward(q, k, v, bases, bias, valid, tok, wsum, mean, coef)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bases, bias, valid, tok, wsum, mean, coef = ctx.saved_tensors
        causal = ctx.causal
        b, h, n, d = q.shape
        lay = _Layout(q, k, v, bases, bias, valid, tok, causal)
        w = lay.w
        nw = tok.shape[1] // w
        r = bases.shape[1]
        grad3 = flat_heads(grad)
        mean3, coef3 = mean.reshape(b * h, -1, r), coef.repeat_interleave(h, 0).view(b * h, -1, 1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq3, dk3, dv3 = flat_heads(dq), flat_heads(dk), flat_heads(dv)
        dbases, dbias = torch.zeros_like(lay.bases), torch.zeros_like(lay.bias)
        dmean = torch.zeros_like(mean3)
        for g in lay.groups:  # pass A: F_global = (p ⊙ H) B with p = softmax(qb ⊙ H) (eq. 4)
            gg = group_rows(grad3, g, w).view(g.heads, -1, d)
            qw = group_rows(lay.q, g, w)
            m = lay.per_window(mean3, g)
            qb, pm = lay.memory_probs(qw, g, m)
            bg, dbg = lay.bases[g.h0:g.h1], dbases[g.h0:g.h1]
            dwgt = torch.bmm(gg, bg.transpose(1, 2)).view_as(qb).mul_(0.5)  # dL/d(p ⊙ H)
            dbg.baddbmm_((pm * m).view(g.heads, -1, r).transpose(1, 2), gg, alpha=0.5)
            dlog = torch._softmax_backward_data(dwgt * m, pm, -1, pm.dtype)
            dm = torch.mul(dwgt, pm).addcmul_(dlog, qb).sum(2)  # (h,G,r)
            if causal:
                dmean[g.h0:g.h1, g.f0:g.f1] += dm
            else:
                dmean[g.h0:g.h1] += dm.sum(1, keepdim=True)
            dqb = dlog.mul_(m).view(g.heads, -1, r)
            dbg.baddbmm_(dqb.transpose(1, 2), qw.view(g.heads, -1, d), alpha=lay.scale)
            bmm_rows(dq3, g, w, dqb, bg, alpha=lay.scale)
        dbases = dbases.view(b, h, r, d).sum(0)
        dwin = _memory_mean_grad(dmean.view(b, h, *mean.shape[2:]), wsum, bases, dbases, tok.view(b, nw, w), causal)
        dwin3 = dwin.reshape(b * h, -1, d)  # dL/d(window sums of x)
        for g in lay.groups:  # pass B: F_local
            p, has_key, qw, ks = lay.local_probs(g)
            dx = torch.mul(group_rows(grad3, g, w).view(g.heads, g.windows, w, d), lay.per_window(coef3, g))
            dx = dx.addcmul_(lay.per_window(dwin3, g), group_rows(lay.tok, g, w).view(g.heads, g.windows, w, 1))
            dx = dx.view(-1, w, d)
            if has_key is not None:
                dx.masked_fill_(~has_key, 0.0)
            lay.add_seen_grad(dv3, g, p, dx)
            ds = torch._softmax_backward_data(torch.bmm(dx, lay.seen(lay.v, g).transpose(1, 2)), p, -1, p.dtype)
            dbias[g.h0:g.h1] += ds.view(g.heads, g.windows, w, -1).sum(1)
            lay.add_seen_grad(dk3, g, ds, qw, alpha=lay.scale)
            bmm_rows(dq3, g, w, ds, ks, beta=1, alpha=lay.scale)
        return dq, dk, dv, dbases, dbias.view(b, *bias.shape).sum(0), None, None, None


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

"""LAVO self-attention's looped implementation (fast on CPUs): windows in groups of working size, q, k, v (B,H,N,D) as
(B·H, N, D) and w-row windows (``windows``).

``forward``'s pass 1 writes F_local into the output buffer and sums it per window, pass 2 adds the memory read-out in
place; only the per-window sums and means (B,H,nw,·) are kept. ``backward`` recomputes the window probabilities and
the memory probabilities group by group.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import working_set
from ..precision import compute_dtype
from ..windows import (
    Group,
    bmm_rows,
    flat_heads,
    group_rows,
    rows_view,
    scaled_bmm,
    store_rows,
    window_groups,
    window_pairs,
)
from .inputs import LavoInputs, band_bias, window_valid
from .memory import memory_mean, memory_mean_grad


def inputs(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, key_padding_mask: Optional[Tensor],
           window: int, causal: bool) -> LavoInputs:
    """q, k, v, bases in the compute dtype, the band bias and the memory's tokens; the real tokens ``valid`` only
    where a key needs masking."""
    ct = compute_dtype(q)
    valid = window_valid(q, window, key_padding_mask)
    bias = band_bias(pos_bias.to(ct), window, causal)
    # padded keys need masking inside windows unless only causal queries past the end could see them
    masked = key_padding_mask is not None or (valid.shape[1] > q.shape[2] and not causal)
    return LavoInputs(q.to(ct), k.to(ct), v.to(ct), bases.to(ct), bias, valid.to(ct), valid if masked else None,
                      causal=causal)


class _Layout:
    """What every pass reads: the inputs with heads flattened (B·H, N, ·), per-head parameters repeated over the
    batch, the window groups (``windows``), and the window softmax of a group."""

    def __init__(self, x: LavoInputs):
        b, h, _, d = x.q.shape
        self.w, self.causal, self.scale = x.bias.shape[1], x.causal, 1.0 / math.sqrt(d)
        self.q, self.k, self.v = flat_heads(x.q), flat_heads(x.k), flat_heads(x.v)
        self.bases, self.bias = x.bases.repeat(b, 1, 1), x.bias.repeat(b, 1, 1)  # (B·H, r, D), (B·H, w, K)
        self.valid = None if x.valid is None else x.valid.repeat_interleave(h, 0)[..., None]  # (B·H, nw*w, 1)
        self.tok = x.tok.repeat_interleave(h, 0)[..., None]
        self.groups = window_groups(b * h, x.q.shape[2], self.w, d, working_set.WORK_ELEMENTS)

    def seen(self, x3: Tensor, g: Group, fill=0) -> Tensor:
        """Keys (values, valid flags) seen by the windows of g: (F,2w,C) [previous, own] window if causal,
        else (F,w,C)."""
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


def forward(x: LavoInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    """0.5 (F_local + F_global) (B,H,N,D) in the compute dtype (F_local alone without memory), and what ``backward``
    needs: the window sums of F_local (B,H,nw,D) and the memory's means and F_local's weights (``memory_mean``)."""
    b, h, n, d = x.q.shape
    lay = _Layout(x)
    w = lay.w
    nw = x.tok.shape[1] // w
    out = x.q.new_empty(b, h, n, d)
    out3 = flat_heads(out)
    win = x.q.new_empty(b * h, nw, d)  # sum of x_t over the memory tokens of each window
    for g in lay.groups:  # pass 1: F_local
        p, has_key, _, _ = lay.local_probs(g)
        xl = torch.bmm(p, lay.seen(lay.v, g))
        if has_key is not None:
            xl.masked_fill_(~has_key, 0.0)
        tokr = group_rows(lay.tok, g, w)  # (F,w,1)
        torch.bmm(tokr.transpose(1, 2), xl, out=win[g.h0:g.h1, g.f0:g.f1].view(-1, 1, d))
        store_rows(out3, g, w, xl)
    mean, coef, wsum = memory_mean(win.view(b, h, nw, d), x.bases, x.tok.view(b, nw, w), x.causal)
    mean3, coef3 = mean.reshape(b * h, -1, x.bases.shape[1]), coef.repeat_interleave(h, 0).view(b * h, -1, 1)
    for g in lay.groups:  # pass 2: out = coef F_local + 0.5 F_global
        m = lay.per_window(mean3, g)
        _, pm = lay.memory_probs(group_rows(lay.q, g, w), g, m)
        glob = torch.bmm(pm.mul_(m * 0.5).view(g.heads, -1, pm.shape[-1]), lay.bases[g.h0:g.h1])
        rows = rows_view(out3, g, w)
        xl = group_rows(out3, g, w) if rows is None else rows
        xl.view(g.heads, g.windows, w, d).mul_(lay.per_window(coef3, g)).add_(glob.view(g.heads, g.windows, w, d))
        if rows is None:
            store_rows(out3, g, w, xl)
    return out, (wsum, mean, coef)


def backward(x: LavoInputs, saved: Tuple[Tensor, Tensor, Tensor], grad: Tensor) -> LavoInputs:
    """dq, dk, dv (B,H,N,D), dbases (H,r,D) and dbias (H,w,K) in the compute dtype from dL/d(out) (B,H,N,D)."""
    wsum, mean, coef = saved
    causal = x.causal
    b, h, n, d = x.q.shape
    lay = _Layout(x)
    w = lay.w
    nw = x.tok.shape[1] // w
    r = x.bases.shape[1]
    grad3 = flat_heads(grad)
    mean3, coef3 = mean.reshape(b * h, -1, r), coef.repeat_interleave(h, 0).view(b * h, -1, 1)
    dq, dk, dv = torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(x.v)
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
    dwin = memory_mean_grad(dmean.view(b, h, *mean.shape[2:]), wsum, x.bases, dbases, x.tok.view(b, nw, w), causal)
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
    return LavoInputs(q=dq, k=dk, v=dv, bases=dbases, bias=dbias.view(b, *x.bias.shape).sum(0))

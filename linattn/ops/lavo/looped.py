"""LAVO's windows in groups of working size: q, k, v (B,H,N,D) as (B·H, N, D), w-row windows, the band bias."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import working_set
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


class _Layout:
    """What every pass of ``_LAVO`` reads: the inputs with heads flattened (B·H, N, ·), per-head parameters
    repeated over the batch, the window groups (``windows``), and the window softmax of a group."""

    def __init__(self, q, k, v, bases, bias, valid, tok, causal: bool):
        b, h, _, d = q.shape
        self.w, self.causal, self.scale = bias.shape[1], causal, 1.0 / math.sqrt(d)
        self.q, self.k, self.v = flat_heads(q), flat_heads(k), flat_heads(v)
        self.bases, self.bias = bases.repeat(b, 1, 1), bias.repeat(b, 1, 1)  # (B·H, r, D), (B·H, w, K)
        self.valid = None if valid is None else valid.repeat_interleave(h, 0)[..., None]  # (B·H, nw*w, 1)
        self.tok = tok.repeat_interleave(h, 0)[..., None]
        self.groups = window_groups(b * h, q.shape[2], self.w, d, working_set.WORK_ELEMENTS)

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


def _band_bias(pos_bias: Tensor, w: int, causal: bool) -> Tensor:
    """(H,w,K): P[j - t + w - 1] for query slot t, key slot j inside the band, -inf outside (LAVO §3.3).

    Causal keys are [previous, own] window (K = 2w, offsets -w+1 .. 0, P[0 .. w-1] at key slots t+1 .. t+w);
    otherwise the own window (K = w). Row t is a slice of P, -inf padded: a Toeplitz matrix (unfold, rows flipped).
    """
    if causal:
        pos_bias = F.pad(pos_bias[:, :w], (w, w - 1), value=float("-inf"))
    return pos_bias.unfold(-1, 2 * w if causal else w, 1).flip(-2)

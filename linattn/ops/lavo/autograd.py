"""LAVO self-attention as an autograd op: q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..impls import resolve_impl
from ..precision import autocast_off, compute_dtype
from ..windows import bmm_rows, flat_heads, group_rows, rows_view, store_rows
from .inputs import _check_lavo
from .looped import _band_bias, _Layout
from .memory import _memory_mean, _memory_mean_grad
from .parallel import _LAVOParallel


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


@autocast_off
def lavo_attention(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *, window: int = 64,
                   causal: bool = True, key_padding_mask: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """LAVO self-attention in O(N (w + r)) time and memory (no N×N matrix).

    q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D). Causal local attention uses
    blocks of w queries against (previous + own) window with a band mask; the causal memory is an
    exclusive cumulative sum over windows of sum_t B x_t and of the token counts. ``impl`` (``forms``):
    ``looped`` holds, beyond the inputs, the output, the gradients and working-size temporaries (``_LAVO``);
    ``parallel`` all windows at once, (B,H,N,K) temporaries, K = 2w causal, w otherwise (``_LAVOParallel``).
    """
    w, key_padding_mask = _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    parallel = resolve_impl(impl, q.device) == "parallel"
    b, n = q.shape[0], q.shape[2]
    ct = compute_dtype(q)
    nw = -(-n // w)
    pad = nw * w - n
    valid = torch.arange(nw * w, device=q.device).expand(b, nw * w) < n
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, pad), value=True)
    bias = _band_bias(pos_bias.to(ct), w, causal)
    if parallel:
        return _LAVOParallel.apply(q, k, v, bases, bias, valid, valid.to(ct), causal)
    # padded keys need masking inside windows unless only causal queries past the end could see them
    masked = key_padding_mask is not None or (pad > 0 and not causal)
    out = _LAVO.apply(q.to(ct), k.to(ct), v.to(ct), bases.to(ct), bias, valid if masked else None, valid.to(ct), causal)
    return out.to(q.dtype)

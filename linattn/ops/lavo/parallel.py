"""LAVO self-attention with every window at once (the ``parallel`` implementation): a fixed number of batched tensor
ops.

The sequence is cut into nw = ceil(N/w) windows, (B,H,N,D) -> (B,H,nw,w,D), zeros past N. Each window's queries
meet the keys they may see in one batched product (B·H·nw, w, K): K = 2w keys [previous, own window] under the
causal band, K = w keys of the own window otherwise (LAVO §3.2-3.3). The memory is an exclusive cumulative sum
over the windows' sums of B x_t (causal) or their total (``memory.memory_mean``, LAVO eq. 3-4). q, k, v and the
bases stay in their own dtype (half is saved as half) and are upcast inside; what is kept beyond the inputs and the
window masks are the per-window sums and means (B,H,nw,·): the backward recomputes both softmaxes.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import compute_dtype
from ..windows import scaled_bmm
from .inputs import LavoInputs, band_bias, window_valid
from .memory import memory_mean, memory_mean_grad


def _windows(x: Tensor, nw: int, w: int, ct: torch.dtype) -> Tensor:
    """(B,H,N,C) -> (B,H,nw,w,C), a new contiguous tensor in ``ct``, zeros past N."""
    b, h, n, c = x.shape
    return F.pad(x.to(ct), (0, 0, 0, nw * w - n)).contiguous().view(b, h, nw, w, c)  # pad and .to keep strides


def _seen(x: Tensor, nw: int, w: int, causal: bool, ct: torch.dtype) -> Tensor:
    """The keys (values) each window sees, (B·H·nw, K, C) contiguous in ``ct``: [previous, own] window if causal
    (a zero window before window 0), else the own window."""
    if not causal:
        return _windows(x, nw, w, ct).view(-1, w, x.shape[-1])
    rows = F.pad(x.to(ct), (0, 0, w, nw * w - x.shape[2]))
    return rows.unfold(2, 2 * w, w).transpose(-1, -2).reshape(-1, 2 * w, x.shape[-1])


def _fold_seen(ds: Tensor, w: int, causal: bool) -> Tensor:
    """Gradient of ``_seen`` for (B,H,nw,K,C): (B,H,nw,w,C); window m gets its own half of row m and the
    previous half of row m + 1 (the previous half of row 0 is the zero window)."""
    if not causal:
        return ds
    return ds[:, :, :, w:].add(F.pad(ds[:, :, 1:, :w], (0, 0, 0, 0, 0, 1)))


def _local_masks(valid: Tensor, bias: Tensor, causal: bool):
    """Where the window scores are dropped, (B,1,nw,w,K), and the queries with no key to see, (B,1,nw,w,1), bool.

    A query sees the keys of its band (bias > -inf) that are real (valid (B,nw*w), False past N); causal window 0
    has no previous window. A keyless query keeps its band's scores (a finite softmax) and is zeroed after.
    """
    w = bias.shape[1]
    if causal:
        key_valid = F.pad(valid, (w, 0), value=False).unfold(1, 2 * w, w)  # (B,nw,2w)
    else:
        key_valid = valid.view(valid.shape[0], -1, w)
    allowed = (bias[0] > float("-inf")) & key_valid[:, None, :, None, :]
    keyless = ~allowed.any(-1, keepdim=True)
    return ~(allowed | keyless), keyless


def _local_probs(qs: Tensor, ks: Tensor, bias: Tensor, drop: Tensor, keyless: Tensor) -> Tensor:
    """Window softmax (LAVO §3.2-3.3): softmax_j(q_t·k_j/sqrt(D) + P[j - t + w - 1]) over the allowed keys,
    (B,H,nw,w,K); qs (B,H,nw,w,D) the scaled queries, ks (B·H·nw,K,D). A row with no allowed key is 0."""
    b, h, nw, w, d = qs.shape
    scores = torch.bmm(qs.view(-1, w, d), ks.transpose(1, 2)).view(b, h, nw, w, -1)
    scores.add_(bias[:, None]).masked_fill_(drop, float("-inf"))
    return torch.softmax(scores, -1).masked_fill_(keyless, 0.0)


def _flat(x: Tensor) -> Tensor:
    """(B,H,nw,w,C) -> (B·H, nw·w, C), a view."""
    return x.view(x.shape[0] * x.shape[1], -1, x.shape[-1])


def _per_window(x: Tensor, causal: bool) -> Tensor:
    """A per-window (B,H,nw,C) (causal) or per-sequence (B,H,C) tensor as (B,H,nw|1,1,C)."""
    return x[:, :, :, None] if causal else x[:, :, None, None]


def _head_bases(bases: Tensor, b: int) -> Tensor:
    """(H,r,D) -> (B·H,r,D), one copy per sequence for batched products."""
    return bases.expand(b, *bases.shape).reshape(-1, *bases.shape[1:])


def inputs(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, key_padding_mask: Optional[Tensor],
           window: int, causal: bool) -> LavoInputs:
    """q, k, v, bases as given (half stays half), the band bias, the memory's tokens and the window masks
    (``_local_masks``)."""
    ct = compute_dtype(q)
    valid = window_valid(q, window, key_padding_mask)
    bias = band_bias(pos_bias.to(ct), window, causal)
    tok = valid.to(ct)
    drop, keyless = _local_masks(valid, bias, causal)
    return LavoInputs(q, k, v, bases, bias, tok, drop=drop, keyless=keyless, causal=causal)


def forward(x: LavoInputs) -> Tuple[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    """0.5 (F_local + F_global) (B,H,N,D) in q's dtype (F_local alone without memory), and what ``backward`` needs:
    the window sums of F_local (B,H,nw,D) and the memory's means and F_local's weights (``memory_mean``)."""
    q, bias, causal = x.q, x.bias, x.causal
    b, h, n, d = q.shape
    w = bias.shape[1]
    nw = x.tok.shape[1] // w
    ct = compute_dtype(q)
    qs = _windows(q, nw, w, ct).mul_(1.0 / math.sqrt(d))
    bases_ = x.bases.to(ct)
    bb = _head_bases(bases_, b)
    p = _local_probs(qs, _seen(x.k, nw, w, causal, ct), bias, x.drop, x.keyless)
    xl = torch.bmm(p.view(-1, w, p.shape[-1]), _seen(x.v, nw, w, causal, ct)).view(b, h, nw, w, d)  # F_local
    tokw = x.tok.view(b, nw, w)
    win = xl.mul(tokw[:, None, :, :, None]).sum(3)  # sum of x_t over each window's memory tokens
    mean, coef, win = memory_mean(win, bases_, tokw, causal)
    meanw = _per_window(mean, causal)
    qb = torch.bmm(_flat(qs), bb.transpose(1, 2)).view(b, h, nw, w, -1)  # q B^T / sqrt(D)
    pm = torch.softmax(qb.mul_(meanw), -1).mul_(meanw * 0.5)  # 0.5 p ⊙ H, p = softmax(q Xtil^T) (eq. 4)
    out = xl.mul_(coef.view(b, 1, -1, 1, 1))  # coef = 0.5 with a memory, 1 without
    _flat(out).baddbmm_(_flat(pm), bb)  # + 0.5 F_global = 0.5 (p ⊙ H) B
    return out.view(b, h, nw * w, d)[:, :, :n].to(q.dtype), (win, mean, coef)


def backward(x: LavoInputs, saved: Tuple[Tensor, Tensor, Tensor], grad: Tensor) -> LavoInputs:
    """dq, dk, dv (B,H,N,D) and dbases (H,r,D) in their inputs' dtype, dbias (H,w,K) in the compute dtype, from
    dL/d(out) (B,H,N,D); both softmaxes recomputed."""
    q, k, v, bases, causal = x.q, x.k, x.v, x.bases, x.causal
    win, mean, coef = saved
    b, h, n, d = q.shape
    w = x.bias.shape[1]
    nw = x.tok.shape[1] // w
    ct = compute_dtype(q)
    qs = _windows(q, nw, w, ct).mul_(1.0 / math.sqrt(d))
    gw = _windows(grad, nw, w, ct)
    bases_ = bases.to(ct)
    tokw = x.tok.view(b, nw, w)
    dq, dbases, dmean = _global_backward(qs, gw, bases_, _per_window(mean, causal), causal)
    dwin = memory_mean_grad(dmean, win, bases_, dbases, tokw, causal)  # dL/d(window sums of x)
    dx = gw.mul_(coef.view(b, 1, -1, 1, 1)).addcmul_(_per_window(dwin, causal), tokw[:, None, :, :, None])
    dk, dv, dbias = _local_backward(qs, dx, x, dq)
    dq, dk, dv = (t.reshape(b, h, nw * w, d)[:, :, :n].to(y.dtype) for t, y in ((dq, q), (dk, k), (dv, v)))
    return LavoInputs(q=dq, k=dk, v=dv, bases=dbases.to(bases.dtype), bias=dbias)


def _global_backward(qs: Tensor, gw: Tensor, bases: Tensor, meanw: Tensor, causal: bool):
    """Backward of 0.5 F_global = 0.5 (p ⊙ H) B, p = softmax(qb ⊙ H), qb = q B^T / sqrt(D) (eq. 4), from the
    output gradient gw (B,H,nw,w,D): dL/dq / sqrt(D) (B,H,nw,w,D), dL/dB (H,r,D) and dL/dH (B,H,nw|·,r)."""
    b, h = qs.shape[:2]
    bb = _head_bases(bases, b)
    qb = torch.bmm(_flat(qs), bb.transpose(1, 2)).view(*qs.shape[:-1], -1)
    pm = torch.softmax(qb * meanw, -1)
    dwgt = scaled_bmm(_flat(gw), bb.transpose(1, 2), 0.5).view_as(qb)  # dL/d(p ⊙ H)
    dbb = scaled_bmm(_flat(pm * meanw).transpose(1, 2), _flat(gw), 0.5)  # (B·H,r,D)
    dlog = torch._softmax_backward_data(dwgt * meanw, pm, -1, pm.dtype)
    dmean = dwgt.mul_(pm).addcmul_(dlog, qb).sum(3 if causal else (2, 3))
    dqb = _flat(dlog.mul_(meanw))
    dbb.baddbmm_(dqb.transpose(1, 2), _flat(qs))
    return torch.bmm(dqb, bb).view_as(qs), dbb.view(b, *bases.shape).sum(0), dmean


def _local_backward(qs: Tensor, dx: Tensor, x: LavoInputs, dq: Tensor):
    """Backward of F_local = p V (LAVO §3.2-3.3) from dx (B,H,nw,w,D): adds dL/dq / sqrt(D) into dq (then scales
    it to dL/dq) and gives dL/dk, dL/dv (B,H,nw,w,D) and dL/dbias (H,w,K). Each (B·H·nw, w, K) or (·, K, D)
    temporary is dropped as soon as it is used (three at a time at most)."""
    b, h, nw, w, d = qs.shape
    causal = x.causal
    ks, vs = _seen(x.k, nw, w, causal, qs.dtype), _seen(x.v, nw, w, causal, qs.dtype)
    p = _local_probs(qs, ks, x.bias, x.drop, x.keyless).view(-1, w, ks.shape[1])
    dx = dx.view(-1, w, d)
    ds = torch.bmm(dx, vs.transpose(1, 2))  # dL/dp
    del vs
    ds.sub_((ds * p).sum(-1, keepdim=True)).mul_(p)  # dL/dscores: the softmax backward, in place
    dv = torch.bmm(p.transpose(1, 2), dx)
    del p, dx
    dv = _fold_seen(dv.view(b, h, nw, -1, d), w, causal)
    dq.view(-1, w, d).baddbmm_(ds, ks).mul_(1.0 / math.sqrt(d))
    del ks
    dk = _fold_seen(torch.bmm(ds.transpose(1, 2), qs.view(-1, w, d)).view(b, h, nw, -1, d), w, causal)
    return dk, dv, ds.view(b, h, nw, w, -1).sum((0, 2))

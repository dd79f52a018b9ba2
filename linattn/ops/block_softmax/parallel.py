"""Block softmax's parallel implementation (for GPUs): every block at once, one (B,H,nb,bs,bs) masked softmax.

``BlockInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in the input dtype (upcast here: half inputs compute in
float32) and as mask the hidden keys (B|1,1,nb,bs|1,bs), True where a query may not see a key of its block
(padded, past the end, or later if causal), or None.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..batched import bmm, chunks, rows
from ..precision import compute_dtype
from .inputs import BlockInputs, hidden_keys, visible_keys


def inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], bs: int, causal: bool) -> BlockInputs:
    """q, k, v in their own dtype and as mask the hidden keys (B|1,1,nb,bs|1,bs), causality included
    (``hidden_keys``), or None."""
    valid = visible_keys(key_padding_mask, q.shape[2], bs, q.device)
    return BlockInputs(q, k, v, hidden_keys(valid, bs, causal, q.device), causal, bs)


def forward(x: BlockInputs, *, average_with: Optional[Tensor] = None) -> Tuple[Tensor, tuple]:
    """Block softmax (B,H,N,Dv), or 0.5 (average_with + block softmax) with ``average_with`` (B,H,N,Dv) in the
    compute dtype; in q's dtype. Nothing to save (the backward recomputes the probabilities)."""
    return _blocks(x, average_with).to(x.q.dtype), ()  # cast once the probabilities are freed


def backward(x: BlockInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0,
             add_to: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (B,H,N,·) of ``scale`` * block softmax, compute dtype (probabilities recomputed); added in place
    to ``add_to`` (another part's dq, dk, dv, as LLN's in LLN+Diag) if given."""
    n = x.q.shape[2]
    p, qb, kb = _probs(x)
    gb = chunks(grad.to(p.dtype), x.block)
    vb = chunks(x.v.to(p.dtype), x.block)
    ds = torch._softmax_backward_data(bmm(gb, vb.transpose(-1, -2)), p, -1, p.dtype)
    ds.mul_(scale / math.sqrt(x.q.shape[-1]))
    dv = bmm(p.transpose(-1, -2), gb)
    if scale != 1:
        dv.mul_(scale)
    grads = rows(bmm(ds, kb), n), rows(bmm(ds.transpose(-1, -2), qb), n), rows(dv, n)
    return grads if add_to is None else tuple(a.add_(b) for a, b in zip(add_to, grads))


def _blocks(x: BlockInputs, average_with: Optional[Tensor]) -> Tensor:
    """``forward``'s output in the compute dtype."""
    p, _, _ = _probs(x)
    vb = chunks(x.v.to(p.dtype), x.block)
    if average_with is None:
        out = bmm(p, vb)
    else:
        out = bmm(p, vb, add=chunks(average_with, x.block), beta=0.5, alpha=0.5)
    return rows(out, x.q.shape[2])


def _probs(x: BlockInputs):
    """softmax(q k^T / sqrt(D)) inside the blocks (LLN §4.2) (B,H,nb,bs,bs), 0 on hidden keys (and on a row with
    none visible), and the blocks of q, k (B,H,nb,bs,D) in the compute dtype."""
    ct = compute_dtype(x.q)
    qb, kb = chunks(x.q.to(ct), x.block), chunks(x.k.to(ct), x.block)
    scores = bmm(qb, kb.transpose(-1, -2)).mul_(1 / math.sqrt(x.q.shape[-1]))
    if x.mask is None:
        return torch.softmax(scores, -1), qb, kb
    # the lowest finite score, not -inf: a row with no visible key gets a finite softmax, then zeroed
    p = torch.softmax(scores.masked_fill_(x.mask, torch.finfo(ct).min), -1)
    return p.masked_fill_(x.mask, 0.0), qb, kb

"""Block softmax's parallel form (the GPU form): every block at once, one (B,H,nb,bs,bs) masked softmax.

q, k (B,H,N,D), v (B,H,N,Dv) in the input dtype (upcast here: half inputs compute in float32); ``hidden``
(B|1,1,nb,bs|1,bs) bool, True where a query may not see a key of its block (padded, past the end, or later if
causal), or None.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ..batched import bmm, chunks, rows
from ..precision import compute_dtype


def hidden_keys(valid: Optional[Tensor], bs: int, causal: bool, device) -> Optional[Tensor]:
    """(B|1,1,nb,bs|1,bs): True where a query may not see a key of its block; ``valid`` from ``block_valid``."""
    hidden = None if valid is None else ~valid.view(valid.shape[0], 1, -1, 1, bs)
    if causal:
        future = torch.ones(bs, bs, dtype=torch.bool, device=device).triu(1)
        hidden = future if hidden is None else hidden | future
    return hidden


def probs(q: Tensor, k: Tensor, hidden: Optional[Tensor], bs: int):
    """softmax(q k^T / sqrt(D)) inside the blocks (LLN §4.2) (B,H,nb,bs,bs), 0 on hidden keys (and on a row with
    none visible), and the blocks of q, k (B,H,nb,bs,D) in the compute dtype."""
    ct = compute_dtype(q)
    qb, kb = chunks(q.to(ct), bs), chunks(k.to(ct), bs)
    scores = bmm(qb, kb.transpose(-1, -2)).mul_(1 / math.sqrt(q.shape[-1]))
    if hidden is None:
        return torch.softmax(scores, -1), qb, kb
    # the lowest finite score, not -inf: a row with no visible key gets a finite softmax, then zeroed
    p = torch.softmax(scores.masked_fill_(hidden, torch.finfo(ct).min), -1)
    return p.masked_fill_(hidden, 0.0), qb, kb


def blocks_forward(q, k, v, hidden, bs, lln_out: Optional[Tensor] = None) -> Tensor:
    """Block softmax (B,H,N,Dv) in the compute dtype; with ``lln_out`` (B,H,N,Dv), 0.5 (lln_out + block softmax)."""
    p, _, _ = probs(q, k, hidden, bs)
    vb = chunks(v.to(p.dtype), bs)
    if lln_out is None:
        out = bmm(p, vb)
    else:
        out = bmm(p, vb, add=chunks(lln_out, bs), beta=0.5, alpha=0.5)
    return rows(out, q.shape[2])


def blocks_backward(q, k, v, hidden, bs, grad, scale: float = 1.0):
    """dq, dk, dv (B,H,N,·) of ``scale`` * block softmax, compute dtype (probabilities recomputed)."""
    n = q.shape[2]
    p, qb, kb = probs(q, k, hidden, bs)
    gb = chunks(grad.to(p.dtype), bs)
    vb = chunks(v.to(p.dtype), bs)
    ds = torch._softmax_backward_data(bmm(gb, vb.transpose(-1, -2)), p, -1, p.dtype)
    ds.mul_(scale / math.sqrt(q.shape[-1]))
    dv = bmm(p.transpose(-1, -2), gb)
    if scale != 1:
        dv.mul_(scale)
    return rows(bmm(ds, kb), n), rows(bmm(ds.transpose(-1, -2), qb), n), rows(dv, n)

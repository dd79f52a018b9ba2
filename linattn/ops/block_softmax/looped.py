"""Block softmax over groups of blocks of working size: ``BlockInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in the
compute dtype, blocks of bs rows; the output and the gradients are written group by group into buffers allocated
once, or into a caller's (LLN+Diag's average)."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import working_set
from ..precision import compute_dtype
from ..windows import Group, bmm_rows, flat_heads, group_rows, scaled_bmm, window_groups
from .inputs import BlockInputs, visible_keys


def inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], bs: int, causal: bool) -> BlockInputs:
    """q, k, v in the compute dtype and as mask the keys a query may see (B|1,nb*bs) (``visible_keys``), or None."""
    ct = compute_dtype(q)
    return BlockInputs(q.to(ct), k.to(ct), v.to(ct), visible_keys(key_padding_mask, q.shape[2], bs, q.device),
                       causal, bs)


def forward(x: BlockInputs, *, average_with: Optional[Tensor] = None) -> Tuple[Tensor, tuple]:
    """Block softmax (B,H,N,Dv) in the compute dtype, or 0.5 (average_with + block softmax), written into
    ``average_with``'s buffer (B,H,N,Dv); nothing to save (the backward recomputes the probabilities)."""
    if average_with is None:
        out = x.q.new_empty(*x.q.shape[:3], x.v.shape[-1])
        _blocks_forward_(x, out, 1.0)
        return out, ()
    _blocks_forward_(x, average_with, 0.5)  # the LLN+Diag average 0.5 (LLN + Diag), LLN already in the buffer
    return average_with, ()


def backward(x: BlockInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0,
             add_to: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (compute dtype) of ``scale`` * block softmax, the probabilities recomputed per group: added into
    ``add_to`` (another part's dq, dk, dv, as LLN's in LLN+Diag), or written into new buffers."""
    grads = (torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(x.v)) if add_to is None else add_to
    _blocks_backward_(x, grad, scale, grads, accumulate=add_to is not None)
    return grads


class _Blocks:
    """The inputs with heads flattened (B·H, N, ·), the valid keys (B·H, nb*bs, 1) or None, and the block
    groups of working size (``windows``)."""

    def __init__(self, x: BlockInputs):
        b, h, n, d = x.q.shape
        self.q, self.k, self.v = flat_heads(x.q), flat_heads(x.k), flat_heads(x.v)
        self.bs, self.causal = x.block, x.causal
        self.valid = None if x.mask is None else x.mask.expand(b, -1).repeat_interleave(h, 0)[..., None]
        self.scale = 1 / math.sqrt(d)
        self.groups = window_groups(b * h, n, x.block, max(d, x.v.shape[-1], x.block), working_set.WORK_ELEMENTS)

    def probs(self, g: Group) -> Tensor:
        """softmax(q k^T / sqrt(D)) inside the blocks of g (LLN §4.2), (F,bs,bs); 0 on a row with no allowed key."""
        bs = self.bs
        scores = scaled_bmm(group_rows(self.q, g, bs), group_rows(self.k, g, bs).transpose(1, 2), self.scale)
        tril = torch.ones(bs, bs, dtype=torch.bool, device=scores.device).tril() if self.causal else None
        if self.valid is None:
            if self.causal:
                scores.masked_fill_(~tril, float("-inf"))
            return torch.softmax(scores, -1)
        allowed = group_rows(self.valid, g, bs, fill=False).transpose(1, 2)  # (F,1,bs)
        if self.causal:
            allowed = allowed & tril
        has_key = allowed.any(-1, keepdim=True)
        scores.masked_fill_(~allowed, float("-inf")).masked_fill_(~has_key, 0.0)
        return torch.softmax(scores, -1).masked_fill_(~has_key, 0.0)


def _blocks_forward_(x: BlockInputs, out: Tensor, mix: float) -> None:
    """out <- (1 - mix) out + mix * block softmax, block group by block group (mix 1: out is overwritten)."""
    lay, out3 = _Blocks(x), flat_heads(out)
    for g in lay.groups:
        bmm_rows(out3, g, lay.bs, lay.probs(g), group_rows(lay.v, g, lay.bs), beta=0.0 if mix == 1 else mix, alpha=mix)


def _blocks_backward_(x: BlockInputs, grad: Tensor, scale: float, grads, accumulate: bool) -> None:
    """dq, dk, dv of ``scale`` * block softmax into ``grads``: added, or written."""
    lay, grad3, bs = _Blocks(x), flat_heads(grad), x.block
    dq3, dk3, dv3 = (flat_heads(t) for t in grads)
    beta = 1.0 if accumulate else 0.0
    for g in lay.groups:
        p = lay.probs(g)
        gw, kw = group_rows(grad3, g, bs), group_rows(lay.k, g, bs)
        ds = torch._softmax_backward_data(torch.bmm(gw, group_rows(lay.v, g, bs).transpose(1, 2)), p, -1, p.dtype)
        bmm_rows(dv3, g, bs, p.transpose(1, 2), gw, beta=beta, alpha=scale)
        bmm_rows(dq3, g, bs, ds, kw, beta=beta, alpha=scale * lay.scale)
        bmm_rows(dk3, g, bs, ds.transpose(1, 2), group_rows(lay.q, g, bs), beta=beta, alpha=scale * lay.scale)

"""Block softmax over groups of blocks of working size: q, k (B,H,N,D), v (B,H,N,Dv), blocks of bs rows."""
import math
from typing import Optional

import torch
from torch import Tensor

from .. import working_set
from ..windows import Group, bmm_rows, flat_heads, group_rows, scaled_bmm, window_groups


class _Blocks:
    """The inputs with heads flattened (B·H, N, ·), the valid keys (B·H, nb*bs, 1) or None, and the block
    groups of working size (``windows``)."""

    def __init__(self, q, k, v, valid, bs: int, causal: bool):
        b, h, n, d = q.shape
        self.q, self.k, self.v, self.bs, self.causal = flat_heads(q), flat_heads(k), flat_heads(v), bs, causal
        self.valid = None if valid is None else valid.expand(b, -1).repeat_interleave(h, 0)[..., None]
        self.scale = 1 / math.sqrt(d)
        self.groups = window_groups(b * h, n, bs, max(d, v.shape[-1], bs), working_set.WORK_ELEMENTS)

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


def blocks_forward_(q, k, v, valid, bs, causal, out, mix: float) -> None:
    """out <- (1 - mix) out + mix * block softmax, block group by block group (mix 1: out is overwritten)."""
    lay, out3 = _Blocks(q, k, v, valid, bs, causal), flat_heads(out)
    for g in lay.groups:  # mix < 1: the LLN+Diag average 0.5 (LLN + Diag), LLN already in out
        bmm_rows(out3, g, bs, lay.probs(g), group_rows(lay.v, g, bs), beta=0.0 if mix == 1 else mix, alpha=mix)


def blocks_backward_(q, k, v, valid, bs, causal, grad, gscale: float, dq, dk, dv, accumulate: bool) -> None:
    """dq, dk, dv of ``gscale`` * block softmax (probabilities recomputed per group): added, or written."""
    lay, grad3 = _Blocks(q, k, v, valid, bs, causal), flat_heads(grad)
    dq3, dk3, dv3 = flat_heads(dq), flat_heads(dk), flat_heads(dv)
    beta = 1.0 if accumulate else 0.0
    for g in lay.groups:
        p = lay.probs(g)
        gw, kw = group_rows(grad3, g, bs), group_rows(lay.k, g, bs)
        ds = torch._softmax_backward_data(torch.bmm(gw, group_rows(lay.v, g, bs).transpose(1, 2)), p, -1, p.dtype)
        bmm_rows(dv3, g, bs, p.transpose(1, 2), gw, beta=beta, alpha=gscale)
        bmm_rows(dq3, g, bs, ds, kw, beta=beta, alpha=gscale * lay.scale)
        bmm_rows(dk3, g, bs, ds.transpose(1, 2), group_rows(lay.q, g, bs), beta=beta, alpha=gscale * lay.scale)


def block_valid(key_padding_mask: Optional[Tensor], n: int, bs: int, device) -> Optional[Tensor]:
    """(B|1, nb*bs) keys a query may see (not padded, before the end), or None when every key may be seen."""
    nb = -(-n // bs)
    if key_padding_mask is None and nb * bs == n:
        return None
    valid = (torch.arange(nb * bs, device=device) < n)[None]
    if key_padding_mask is not None:
        valid = valid & ~torch.nn.functional.pad(key_padding_mask, (0, nb * bs - n), value=True)
    return valid

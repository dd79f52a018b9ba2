"""Softmax attention restricted to diagonal blocks (LLN §4.2, Fig. 3: the "Diag" of LLN+Diag)."""
import math
from typing import Optional

import torch
from torch import Tensor

from ._checks import (Rows, allowed_keys, autocast_off, check_key_padding_mask, check_positive_int, check_qkv,
                      compute_dtype, masked_softmax, select_rows)
from ._windows import Group, bmm_rows, flat_heads, group_rows, scaled_bmm, window_groups


_WORK_ELEMENTS = 1 << 20  # values in one (rows, max(D, bs)) working temporary


class _Blocks:
    """The inputs with heads flattened (B·H, N, ·), the valid keys (B·H, nb*bs, 1) or None, and the block
    groups of working size (``_windows``)."""

    def __init__(self, q, k, v, valid, bs: int, causal: bool):
        b, h, n, d = q.shape
        self.q, self.k, self.v, self.bs, self.causal = flat_heads(q), flat_heads(k), flat_heads(v), bs, causal
        self.valid = None if valid is None else valid.expand(b, -1).repeat_interleave(h, 0)[..., None]
        self.scale = 1 / math.sqrt(d)
        self.groups = window_groups(b * h, n, bs, max(d, v.shape[-1], bs), _WORK_ELEMENTS)

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


class _BlockSoftmax(torch.autograd.Function):
    """Block-diagonal softmax with a hand-written backward that recomputes the probabilities per group
    of blocks; q, k, v (B,H,N,·) compute dtype, valid (B,nb*bs) or None. Saves only the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, valid, bs: int, causal: bool):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        blocks_forward_(q, k, v, valid, bs, causal, out, 1.0)
        ctx.save_for_backward(q, k, v, valid)
        ctx.bs, ctx.causal = bs, causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, valid = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        blocks_backward_(q, k, v, valid, ctx.bs, ctx.causal, grad, 1.0, dq, dk, dv, accumulate=False)
        return dq, dk, dv, None, None, None


def block_valid(key_padding_mask: Optional[Tensor], n: int, bs: int, device) -> Optional[Tensor]:
    """(B|1, nb*bs) keys a query may see (not padded, before the end), or None when every key may be seen."""
    nb = -(-n // bs)
    if key_padding_mask is None and nb * bs == n:
        return None
    valid = (torch.arange(nb * bs, device=device) < n)[None]
    if key_padding_mask is not None:
        valid = valid & ~torch.nn.functional.pad(key_padding_mask, (0, nb * bs - n), value=True)
    return valid


@autocast_off
def block_softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Tokens [m*bs, (m+1)*bs) attend to keys of their own block only; a shorter last block.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). Padded keys are masked inside blocks; causal adds
    a lower-triangular mask in each block. Queries with no allowed key get 0. O(N * bs) time; beyond
    the inputs it holds the output, the gradients and working-size temporaries (``_BlockSoftmax``).
    """
    check_qkv(q, k, v)
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n = q.shape[2]
    bs = min(block_size, n)
    ct = compute_dtype(q)
    valid = block_valid(key_padding_mask, n, bs, q.device)
    return _BlockSoftmax.apply(q.to(ct), k.to(ct), v.to(ct), valid, bs, causal).to(q.dtype)


def block_softmax_weights(q: Tensor, k: Tensor, *, block_size: int = 64, causal: bool = False,
                          key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the N×N block-diagonal softmax (LLN §4.2): keys in the query's block (j <= i if causal), not padded.

    q, k (B,H,N,D) -> (B,H,R,N) in the compute dtype; ``rows`` as ``select_rows``; a query with no key gets 0.
    """
    check_qkv(q, k, k)
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n, ct = q.shape[2], compute_dtype(q)
    index = select_rows(rows, n, q.device)
    blk = torch.arange(n, device=q.device) // block_size
    allowed = allowed_keys(index, n, causal=causal, key_padding_mask=key_padding_mask) \
        & (blk[None, :] == blk[index][:, None])
    scores = q[:, :, index].to(ct) @ k.to(ct).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return masked_softmax(scores, allowed)


def block_softmax_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64,
                                      causal: bool = False, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``block_softmax_weights`` @ v: N×N softmax, mask "same block (and j <= i if causal), key not padded"."""
    check_qkv(q, k, v)
    p = block_softmax_weights(q, k, block_size=block_size, causal=causal, key_padding_mask=key_padding_mask)
    return (p @ v.to(p.dtype)).to(q.dtype)

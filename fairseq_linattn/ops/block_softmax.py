"""Softmax attention restricted to diagonal blocks (LLN §4.2, Fig. 3: the "Diag" of LLN+Diag)."""
import math
from typing import Optional

import torch
from torch import Tensor

from ._checks import (Rows, allowed_keys, autocast_off, check_key_padding_mask, check_positive_int, check_qkv,
                      compute_dtype, masked_softmax, select_rows)


_WORK_ELEMENTS = 1 << 20  # values in one (B,H,rows,D) working temporary
_MIN_PASSES = 16  # so that a pass's temporaries stay a small fraction of an (N, D) tensor


def _blocks(x: Tensor, bs: int, f0: int, f1: int) -> Tensor:
    """Rows of blocks [f0, f1) of x (B,H,N,C) as (B,H,G,bs,C), zero-padded past the end (no copy otherwise)."""
    part = x[:, :, f0 * bs:f1 * bs]
    if part.shape[2] < (f1 - f0) * bs:
        part = torch.nn.functional.pad(part, (0, 0, 0, (f1 - f0) * bs - part.shape[2]))
    return part.unflatten(2, (-1, bs))


def _block_groups(q: Tensor, bs: int):
    """Groups of consecutive blocks [f0, f1) of working size."""
    b, h, n, d = q.shape
    nb = -(-n // bs)
    per = max(1, min(_WORK_ELEMENTS // (b * h * bs * max(d, bs)), nb // _MIN_PASSES))
    return [(f0, min(f0 + per, nb)) for f0 in range(0, nb, per)]


def _block_probs(q, k, valid, bs, f0, f1, causal):
    """softmax(q k^T / sqrt(D)) inside blocks [f0, f1) (LLN §4.2): p (B,H,G,bs,bs), has_key (B,1,G,bs,1) or None.

    valid (B,nb*bs) marks the keys a query may see (None: all); a row with no allowed key is finite, zeroed by
    the caller through has_key.
    """
    scores = (_blocks(q, bs, f0, f1) @ _blocks(k, bs, f0, f1).transpose(-1, -2)).mul_(1 / math.sqrt(q.shape[-1]))
    tril = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril() if causal else None
    if valid is None:
        if causal:
            scores.masked_fill_(~tril, float("-inf"))
        return torch.softmax(scores, -1), None
    allowed = valid[:, None, f0 * bs:f1 * bs].unflatten(2, (-1, bs))[:, :, :, None, :]  # (B,1,G,1,bs)
    if causal:
        allowed = allowed & tril
    has_key = allowed.any(-1, keepdim=True)
    scores.masked_fill_(~allowed, float("-inf")).masked_fill_(~has_key, 0.0)
    return torch.softmax(scores, -1), has_key


def blocks_forward_(q, k, v, valid, bs, causal, out, mix: float) -> None:
    """out <- (1 - mix) out + mix * block softmax, block group by block group (mix 1: out is overwritten)."""
    n = q.shape[2]
    for f0, f1 in _block_groups(q, bs):
        p, has_key = _block_probs(q, k, valid, bs, f0, f1, causal)
        x = (p @ _blocks(v, bs, f0, f1)).flatten(2, 3)[:, :, :n - f0 * bs]
        if has_key is not None:
            x.masked_fill_(~has_key.flatten(2, 3)[:, :, :x.shape[2]], 0.0)
        rows = out[:, :, f0 * bs:f0 * bs + x.shape[2]]
        if mix == 1:
            rows.copy_(x)
        else:
            rows.add_(x).mul_(mix)  # the LLN+Diag average 0.5 (LLN + Diag)


def blocks_backward_(q, k, v, valid, bs, causal, grad, gscale: float, dq, dk, dv, accumulate: bool) -> None:
    """dq, dk, dv of ``gscale`` * block softmax (probabilities recomputed per group): added, or written."""
    n = q.shape[2]
    scale = 1 / math.sqrt(q.shape[-1])
    for f0, f1 in _block_groups(q, bs):
        p, has_key = _block_probs(q, k, valid, bs, f0, f1, causal)
        g = _blocks(grad, bs, f0, f1)
        if gscale != 1:
            g = g * gscale
        if has_key is not None:
            g = g.masked_fill(~has_key, 0.0)
        dp = g @ _blocks(v, bs, f0, f1).transpose(-1, -2)
        ds = dp.sub_((dp * p).sum(-1, keepdim=True)).mul_(p * scale)  # softmax backward, times 1/sqrt(D)
        rows = slice(f0 * bs, min(f1 * bs, n))
        for dst, val in ((dv, p.transpose(-1, -2) @ g), (dq, ds @ _blocks(k, bs, f0, f1)),
                         (dk, ds.transpose(-1, -2) @ _blocks(q, bs, f0, f1))):
            val = val.flatten(2, 3)[:, :, :rows.stop - rows.start]
            if accumulate:
                dst[:, :, rows] += val
            else:
                dst[:, :, rows] = val


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

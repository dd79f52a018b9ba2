"""Softmax attention restricted to diagonal blocks (LLN §4.2, Fig. 3: the "Diag" of LLN+Diag)."""
import math
from typing import Optional

import torch
from torch import Tensor

from ._checks import (Rows, allowed_keys, autocast_off, check_key_padding_mask, check_positive_int, check_qkv,
                      compute_dtype, masked_softmax, select_rows)


def _pad_to_blocks(x: Tensor, block_size: int) -> Tensor:
    """(B,H,N,D) -> (B,H,nb,bs,D), zero-padded at the end."""
    b, h, n, d = x.shape
    nb = -(-n // block_size)
    x = torch.nn.functional.pad(x, (0, 0, 0, nb * block_size - n))
    return x.view(b, h, nb, block_size, d)


def _unmasked_blocks(q: Tensor, k: Tensor, v: Tensor, block_size: int, causal: bool) -> Tensor:
    """Softmax inside consecutive blocks of a length divisible by ``block_size``; no padding, no copies.

    (B,H,nb*bs,D) -> (B,H,nb*bs,Dv); every query has a key (itself), so the softmax is finite.
    """
    b, h, n, d = q.shape
    nb = n // block_size
    qb, kb, vb = (t.view(b, h, nb, block_size, t.shape[-1]) for t in (q, k, v))
    scores = (qb @ kb.transpose(-1, -2)).mul_(1 / math.sqrt(d))  # (B,H,nb,bs,bs)
    if causal:
        scores.masked_fill_(~torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).tril(),
                            float("-inf"))
    return (torch.softmax(scores, -1) @ vb).view(b, h, n, -1)


def _masked_blocks(q: Tensor, k: Tensor, v: Tensor, bs: int, causal: bool, key_padding_mask: Tensor) -> Tensor:
    """Blocks with padded keys masked (the last block zero-padded to bs); queries with no key get 0."""
    b, h, n, d = q.shape
    qb, kb, vb = (_pad_to_blocks(t, bs) for t in (q, k, v))
    nb = qb.shape[2]
    valid = torch.arange(nb * bs, device=q.device) < n  # the zero-padding of the last block
    kpm = torch.nn.functional.pad(key_padding_mask, (0, nb * bs - n), value=True).view(b, nb, bs)
    allowed = (valid.view(1, nb, bs) & ~kpm)[:, None, :, None, :]  # (B,1,nb,1,bs) over keys
    if causal:
        allowed = allowed & torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril()
    scores = qb @ kb.transpose(-1, -2) / math.sqrt(d)  # (B,H,nb,bs,bs)
    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~has_key, 0.0)  # keep softmax finite on empty rows; zeroed below
    out = (torch.softmax(scores, -1) @ vb).masked_fill(~has_key, 0.0)
    return out.reshape(b, h, nb * bs, -1)[:, :, :n]


@autocast_off
def block_softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Tokens [m*bs, (m+1)*bs) attend to keys of their own block only; a shorter last block.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). Padded keys are masked inside blocks; causal adds
    a lower-triangular mask in each block. Queries with no allowed key get 0. O(N * bs) time/memory.
    Without padding the whole blocks and the shorter last one are two mask-free batched products.
    """
    check_qkv(q, k, v)
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n = q.shape[2]
    bs = min(block_size, n)
    ct = compute_dtype(q)
    q_, k_, v_ = (t.to(ct) for t in (q, k, v))
    if key_padding_mask is not None:
        return _masked_blocks(q_, k_, v_, bs, causal, key_padding_mask).to(q.dtype)
    whole = n - n % bs
    parts = [_unmasked_blocks(q_[:, :, :whole], k_[:, :, :whole], v_[:, :, :whole], bs, causal)]
    if whole < n:
        parts.append(_unmasked_blocks(q_[:, :, whole:], k_[:, :, whole:], v_[:, :, whole:], n - whole, causal))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
    return out.to(q.dtype)


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

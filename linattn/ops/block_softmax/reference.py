"""Materialised block-diagonal softmax (LLN §4.2): rows (B,H,R,N) and their product with v."""
import math
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..masking import Rows, masked_softmax, select_rows
from ..precision import compute_dtype
from ..real_tokens import ranks, real_first_order


def block_softmax_weights(q: Tensor, k: Tensor, *, block_size: int = 64, causal: bool = False,
                          key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the N×N block-diagonal softmax (LLN §4.2): keys in the query's block (j <= i if causal), not padded.
    Blocks and causality count positions in each row's real-first order (``real_tokens``): its real tokens as if
    its padding were removed, then its padded ones.

    q, k (B,H,N,D) -> (B,H,R,N) in the compute dtype; ``rows`` as ``select_rows``; a query with no key gets 0.
    """
    check_qkv(q, k, k)
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n, ct = q.shape[2], compute_dtype(q)
    index = select_rows(rows, n, q.device)
    pos = _positions(key_padding_mask, n, q.device)  # (B|1, N): each token's place in its row's order
    blk, at = pos // block_size, pos[:, index]
    allowed = blk[:, None, :] == (at // block_size)[:, :, None]  # (B|1, R, N)
    if causal:
        allowed = allowed & (pos[:, None, :] <= at[:, :, None])
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, :]
    scores = q[:, :, index].to(ct) @ k.to(ct).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return masked_softmax(scores, allowed[:, None])


def _positions(key_padding_mask: Optional[Tensor], n: int, device) -> Tensor:
    """(B, N) each token's position in its row's real-first order (the inverse of the order), or (1, N) 0..N-1."""
    if key_padding_mask is None:
        return torch.arange(n, device=device)[None]
    return ranks(real_first_order(key_padding_mask)[0])


def block_softmax_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64,
                                      causal: bool = False, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``block_softmax_weights`` @ v: N×N softmax, mask "same block (and j <= i if causal), key not padded"."""
    check_qkv(q, k, v)
    p = block_softmax_weights(q, k, block_size=block_size, causal=causal, key_padding_mask=key_padding_mask)
    return (p @ v.to(p.dtype)).to(q.dtype)

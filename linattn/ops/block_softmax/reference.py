"""Materialised block-diagonal softmax (LLN §4.2): rows (B,H,R,N) and their product with v."""
import math
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..masking import Rows, allowed_keys, masked_softmax, select_rows
from ..precision import compute_dtype


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

"""Materialised softmax attention (Vaswani et al. eq. 1): rows P (B,H,R,S) and P V."""
import math
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_qkv
from ..masking import Rows, masked_softmax, select_rows
from .masks import _allowed, check_attn_mask


def softmax_attention_weights(q: Tensor, k: Tensor, *, causal: bool = False,
                              key_padding_mask: Optional[Tensor] = None,
                              attn_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """P = softmax(q k^T / sqrt(D) + attn_mask) (Vaswani et al. eq. 1), (B,H,R,S) in q's dtype.

    ``rows``: the query rows to materialise (``select_rows``: None all, an int evenly spaced, or indices).
    Rows with no allowed key are 0.
    """
    index = select_rows(rows, q.shape[2], q.device)
    scores = q[:, :, index] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bias = check_attn_mask(attn_mask, q, k)
    if bias is not None:
        scores = scores + bias[index]
    allowed = _allowed(q, k, causal, key_padding_mask)
    if bias is None and allowed is None:
        return torch.softmax(scores, -1)
    if allowed is not None and allowed.shape[2] > 1:
        allowed = allowed[:, :, index]
    return masked_softmax(scores, allowed)  # NaN scores stay NaN: nothing hidden


def softmax_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                                key_padding_mask: Optional[Tensor] = None,
                                attn_mask: Optional[Tensor] = None) -> Tensor:
    """Materialised softmax(q k^T / sqrt(D)) v (Vaswani et al. eq. 1), in q's dtype."""
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    return softmax_attention_weights(q, k, causal=causal, key_padding_mask=key_padding_mask,
                                     attn_mask=attn_mask) @ v

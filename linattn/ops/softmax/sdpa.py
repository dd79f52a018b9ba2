"""Softmax attention through PyTorch's ``scaled_dot_product_attention``: q (B,H,N,D), k, v (B,H,S,·)."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..inputs import check_key_padding_mask, check_qkv
from .masks import _scores_bias


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                      key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                      dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(D) + attn_mask) v through ``scaled_dot_product_attention``.

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv). Causal alignment is bottom-right
    (query i sees keys j <= i + S - N). ``attn_mask`` (N,S) as fairseq's: float added to the scores,
    or bool with True = blocked. Queries with no allowed key get 0, never NaN.
    ``dropout_p`` drops attention weights (training only; the modules pass it).
    """
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    if key_padding_mask is None and attn_mask is None and (not causal or q.shape[2] == k.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)
    bias, has_key = _scores_bias(q, k, causal, key_padding_mask, attn_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    return out if has_key is None else out.masked_fill(~has_key, 0.0)

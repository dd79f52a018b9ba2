"""Softmax attention: the baseline every linear method is compared against (SPEC §2)."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_key_padding_mask, check_qkv


def _allowed(q: Tensor, k: Tensor, causal: bool, key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """(B, 1, N, S) bool: True where query i may attend to key j; None when everything is allowed."""
    n, s = q.shape[2], k.shape[2]
    allowed = None
    if causal:
        allowed = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)[None, None]
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    return allowed


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                      key_padding_mask: Optional[Tensor] = None, dropout_p: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(D)) v through ``scaled_dot_product_attention``.

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv). Causal alignment is bottom-right
    (query i sees keys j <= i + S - N). Queries with no allowed key get 0, never NaN.
    ``dropout_p`` drops attention weights (training only; the modules pass it).
    """
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    if key_padding_mask is None and (not causal or q.shape[2] == k.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)
    allowed = _allowed(q, k, causal, key_padding_mask)
    has_key = allowed.any(-1, keepdim=True)
    # a row with no allowed key would make SDPA return NaN (and NaN gradients): open it, then zero it
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, dropout_p=dropout_p)
    return out.masked_fill(~has_key, 0.0)


def softmax_attention_weights(q: Tensor, k: Tensor, *, causal: bool = False,
                              key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The materialised matrix P = softmax(q k^T / sqrt(D)) (B,H,N,S); rows with no allowed key are 0."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = _allowed(q, k, causal, key_padding_mask)
    if allowed is None:
        return torch.softmax(scores, -1)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)


def softmax_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                                key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Materialised softmax(q k^T / sqrt(D)) v (Vaswani et al. eq. 1), in q's dtype."""
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    return softmax_attention_weights(q, k, causal=causal, key_padding_mask=key_padding_mask) @ v

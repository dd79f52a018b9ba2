"""Softmax attention: the baseline every linear method is compared against (Vaswani et al. eq. 1)."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import Rows, check_key_padding_mask, check_qkv, masked_softmax, select_rows


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


def check_attn_mask(attn_mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """fairseq's ``attn_mask`` (N, S): float added to the scores (-inf blocks) or bool (True blocks).

    Returned as an additive float mask in q's compute dtype, or None.
    """
    if attn_mask is None:
        return None
    n, s = q.shape[2], k.shape[2]
    if not isinstance(attn_mask, Tensor) or tuple(attn_mask.shape) != (n, s):
        shape = tuple(attn_mask.shape) if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise ValueError(f"attn_mask must have shape (N, S) = {(n, s)}, got {shape}")
    if attn_mask.dtype == torch.bool:
        return torch.zeros(n, s, dtype=q.dtype, device=q.device).masked_fill(attn_mask, float("-inf"))
    if not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be float (added to the scores) or bool (True = blocked), "
                         f"got dtype {attn_mask.dtype}")
    return attn_mask.to(q.dtype)


def _scores_bias(q: Tensor, k: Tensor, causal: bool, key_padding_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor]):
    """(bias (B,1,N,S) float or bool for SDPA, has_key (B,1,N,1) or None): every mask in one, rows with no
    allowed key opened (SDPA would give NaN there) and reported so their output can be set to 0."""
    allowed = _allowed(q, k, causal, key_padding_mask)
    bias = check_attn_mask(attn_mask, q, k)
    if bias is None:
        if allowed is None:
            return None, None
        has_key = allowed.any(-1, keepdim=True)
        return allowed | ~has_key, has_key
    blocked = torch.isneginf(bias)
    allowed = ~blocked if allowed is None else allowed & ~blocked
    has_key = allowed.any(-1, keepdim=True)
    bias = bias.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    return bias, has_key


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

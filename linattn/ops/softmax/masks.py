"""Masks of softmax attention: causal (bottom-right) and key padding as (B,1,N,S) bool, fairseq's attn_mask (N,S)."""
from typing import Optional

import torch
from torch import Tensor


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

"""Materialised kernelized attention (Skyformer §4.1): C (B,H,N,S) from pairwise differences, C V, and the
row-stochastic P of kernel rows."""
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..precision import compute_dtype
from .kernel import check_non_causal, kernel_scale


def kernel_attention_weights(c: Tensor) -> Tensor:
    """Row-stochastic P = C+ / (C+ 1) from kernel rows C (B,H,R,S), C+ = max(C, 0); a row summing to 0 stays 0.

    A kernel method's output C V is (C 1) * (P V) where C >= 0. Negative entries (Skyformer's Nyström
    approximation, from its approximate inverse) are set to 0 before normalising.
    """
    c = c.clamp_min(0.0)
    return c / c.sum(-1, keepdim=True).clamp_min(torch.finfo(c.dtype).tiny)


def kernelized_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                                   causal: bool = False, chunk_size: int = 1024) -> Tensor:
    """C V with C_ij = exp(-|q_i - k_j|²/2) materialised from pairwise differences (chunk_size unused)."""
    check_non_causal("kernelized", "exact Gaussian-kernel attention over the whole sequence", causal)
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    check_positive_int("chunk_size", chunk_size)
    ct = compute_dtype(q)
    scale = kernel_scale(q)
    diff = q.to(ct)[:, :, :, None, :] * scale - k.to(ct)[:, :, None, :, :] * scale  # (B,H,N,S,D)
    c = torch.exp(-0.5 * (diff * diff).sum(-1))  # Skyformer §4.1
    if key_padding_mask is not None:
        c = c.masked_fill(key_padding_mask[:, None, None, :], 0.0)
        v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return (c @ v.to(ct)).to(q.dtype)

"""Kernelized attention: the exact Gaussian-kernel form Skyformer approximates (Skyformer §4.1; docs/design.md §5).

Non-causal only. No row normalisation: ``out = C V`` with C the (unnormalised) Gaussian kernel matrix.
"""
from typing import Optional

import torch
from torch import Tensor

from ._checks import (Rows, autocast_off, check_key_padding_mask, check_positive_int, check_qkv, compute_dtype,
                      select_rows)

_NON_CAUSAL_HELP = ("causal=True is not supported: decoder self-attention needs a causal method "
                    "(`python -m linattn.methods list --role decoder`)")


def check_non_causal(method: str, what: str, causal) -> None:
    """Raise for causal=True: Gaussian-kernel methods attend over the whole sequence."""
    if causal:
        raise ValueError(f"{method} is a non-causal method ({what}); {_NON_CAUSAL_HELP}")


def kernel_scale(q: Tensor) -> float:
    """D^(-1/4) with D the real head dim (the authors' code hard-codes 32^(-1/4))."""
    return q.shape[-1] ** -0.25


def gaussian_kernel(a: Tensor, b: Tensor) -> Tensor:
    """kappa(a_i, b_j) = exp(a_i·b_j - |a_i|²/2 - |b_j|²/2) (Skyformer §4.1).

    a (...,N,D), b (...,M,D) -> (...,N,M)."""
    exponent = a @ b.transpose(-1, -2) - 0.5 * (a * a).sum(-1, keepdim=True) - 0.5 * (b * b).sum(-1)[..., None, :]
    return torch.exp(exponent.clamp_max(0.0))  # the exponent is -|a_i-b_j|²/2 <= 0: clamp rounding only


def _prepare(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]):
    """q, k scaled by D^(-1/4) and v, in the compute dtype; padded rows of k and v zeroed so that
    whatever they hold (even inf) reaches neither outputs nor gradients."""
    ct = compute_dtype(q)
    scale = kernel_scale(q)
    qs, ks, v = q.to(ct) * scale, k.to(ct) * scale, v.to(ct)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :, None]
        ks, v = ks.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    return qs, ks, v


def _exact_kernel(qs: Tensor, ks: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    c = gaussian_kernel(qs, ks)
    if key_padding_mask is not None:
        c = c.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return c


@autocast_off
def kernelized_attention(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                         causal: bool = False, chunk_size: int = 1024) -> Tensor:
    """out = C V, C_ij = exp(q_i·k_j - |q_i|²/2 - |k_j|²/2) on q, k scaled by D^(-1/4).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv). Exact (quadratic by nature); computed in
    blocks of ``chunk_size`` query rows so the forward holds at most chunk_size×S kernel entries.
    Padded keys' columns of C are zero.
    """
    check_non_causal("kernelized", "exact Gaussian-kernel attention over the whole sequence", causal)
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    qs, ks, v = _prepare(q, k, v, key_padding_mask)
    out = [_exact_kernel(qc, ks, key_padding_mask) @ v for qc in qs.split(chunk_size, dim=2)]
    return torch.cat(out, dim=2).to(q.dtype)


def kernelized_kernel_matrix(q: Tensor, k: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                             rows: Rows = None) -> Tensor:
    """Rows of the exact C (B,H,R,S) of ``kernelized_attention`` in the compute dtype (analysis and tests);
    ``rows`` as ``select_rows``."""
    check_qkv(q, k, k, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    qs, ks, _ = _prepare(q, k, k, key_padding_mask)
    return _exact_kernel(qs[:, :, select_rows(rows, q.shape[2], q.device)], ks, key_padding_mask)


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

"""The Gaussian kernel (Skyformer §4.1) on q, k scaled by D^(-1/4): kappa (...,N,M) and rows of C (B,H,R,S); the
inputs of kernelized attention as its implementations take them (``KernelizedInputs``)."""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_qkv
from ..masking import Rows, select_rows
from ..precision import compute_dtype

_NON_CAUSAL_HELP = ("causal=True is not supported: decoder self-attention needs a causal method "
                    "(`python -m linattn_tools.methods_cli list --role decoder`)")


class KernelizedInputs(NamedTuple):
    """Kernelized attention's validated inputs, in their own dtype: q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv), pad (B,S)
    or None, chunk_size: query rows per block of the looped implementation."""
    q: Tensor
    k: Tensor
    v: Tensor
    pad: Optional[Tensor]
    chunk_size: int


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


def scaled_inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]):
    """q, k scaled by D^(-1/4) and v, in the compute dtype; padded rows of k and v zeroed so that
    whatever they hold (even inf) reaches neither outputs nor gradients."""
    ct = compute_dtype(q)
    scale = kernel_scale(q)
    qs, ks, v = q.to(ct) * scale, k.to(ct) * scale, v.to(ct)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :, None]
        ks, v = ks.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    return qs, ks, v


def masked_kernel(qs: Tensor, ks: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """C = kappa(q_s, k_s) (B,H,R,S) of scaled inputs, padded keys' columns 0."""
    c = gaussian_kernel(qs, ks)
    if key_padding_mask is not None:
        c = c.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return c


def kernelized_kernel_matrix(q: Tensor, k: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                             rows: Rows = None) -> Tensor:
    """Rows of the exact C (B,H,R,S) of ``kernelized_attention`` in the compute dtype (analysis and tests);
    ``rows`` as ``select_rows``."""
    check_qkv(q, k, k, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    qs, ks, _ = scaled_inputs(q, k, k, key_padding_mask)
    return masked_kernel(qs[:, :, select_rows(rows, q.shape[2], q.device)], ks, key_padding_mask)

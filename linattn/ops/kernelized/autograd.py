"""Kernelized attention as an op: q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv).

No autograd Function of its own: both implementations (``IMPLEMENTATIONS``: ``looped.py``, ``parallel.py``) are
plain autograd ops (the parallel implementation's input augmentation has its own small Function, SDPA its own backward),
so each has only ``forward(x) -> out`` over ``KernelizedInputs``, and the gradient is autograd's.
"""
from typing import Optional

from torch import Tensor

from ..impls import resolve_impl
from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..precision import autocast_off
from . import looped, parallel
from .kernel import KernelizedInputs, check_non_causal

IMPLEMENTATIONS = {"looped": looped, "parallel": parallel}


@autocast_off
def kernelized_attention(q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None,
                         causal: bool = False, chunk_size: int = 1024,
                         impl: str = "auto") -> Tensor:
    """out = C V, C_ij = exp(q_i·k_j - |q_i|²/2 - |k_j|²/2) on q, k scaled by D^(-1/4).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv). Exact (quadratic by nature). ``looped``: blocks of
    ``chunk_size`` query rows, so the forward holds at most chunk_size×S kernel entries; ``parallel``: one
    ``scaled_dot_product_attention`` call on augmented inputs (chunk_size unused).
    Padded keys' columns of C are zero.
    """
    check_non_causal("kernelized", "exact Gaussian-kernel attention over the whole sequence", causal)
    check_qkv(q, k, v, same_length=False)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    x = KernelizedInputs(q, k, v, key_padding_mask, chunk_size)
    return IMPLEMENTATIONS[resolve_impl(impl, q.device)].forward(x)

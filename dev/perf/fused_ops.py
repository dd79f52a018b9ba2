"""The ops behind each family of fused kernels, as the tuner runs them (``tune_fused``): inputs at a shape, the op's
call with ``impl``, its float64 reference and the tolerance row it is judged by.

Families: ``lln`` (kernels ``lln_*``), ``block`` (``block_softmax*``, LLN+Diag's diagonal part), ``skyformer``
(``nystrom_*``: the Nyström apply, against its materialised float64 form with the same landmarks) and ``lavo``
(``lavo_*``). H heads of D = Dv = 64; LAVO's bases (r = D) and bias, LLN's per-head alpha != beta.
"""
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from linattn import ops


def _lln_extras(heads: int, dtype, device, gen) -> list:
    return [torch.linspace(0.8, 1.2, heads, device=device).view(1, heads, 1, 1), 0.9]  # alpha per head, != beta


def _lavo_extras(heads: int, dtype, device, gen) -> list:
    return [ops.lavo_init_bases(heads, 64, 64, device=device).to(dtype),
            0.1 * torch.randn(heads, 127, generator=gen, device=device)]  # bases (H, D, D), bias (H, 2w - 1)


def _lln(q, k, v, extra, causal, mask, impl):
    alpha, beta = extra
    if impl == "reference":
        return ops.lln_attention_reference(q, k, v, alpha.double(), beta, causal=causal, key_padding_mask=mask)
    return ops.lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=mask, chunk_size=64, impl=impl)


def _block(q, k, v, extra, causal, mask, impl):
    if impl == "reference":
        return ops.block_softmax_attention_reference(q, k, v, block_size=64, causal=causal, key_padding_mask=mask)
    return ops.block_softmax_attention(q, k, v, block_size=64, causal=causal, key_padding_mask=mask, impl=impl)


def _skyformer(q, k, v, extra, causal, mask, impl):
    kw = dict(num_landmarks=128, key_padding_mask=mask, training=False)
    if impl == "reference":  # the Nyström form, materialised with the same landmarks
        v0 = v if mask is None else v.masked_fill(mask[:, None, :, None], 0.0)
        return ops.skyformer_kernel_matrix(q, k, **kw) @ v0
    return ops.skyformer_attention(q, k, v, impl=impl, **kw)


def _lavo(q, k, v, extra, causal, mask, impl):
    bases, pos_bias = extra
    if impl == "reference":
        return ops.lavo_attention_reference(q, k, v, bases.double(), pos_bias.double(), window=64, causal=causal,
                                            key_padding_mask=mask)
    return ops.lavo_attention(q, k, v, bases, pos_bias, window=64, causal=causal, key_padding_mask=mask, impl=impl)


class Family(NamedTuple):
    """A family's op: its tolerance row (``linattn/tolerances.py``), the causalities it is checked and timed in,
    whether a kernel's name says its causality (LLN's), whether the causal check pads (LLN's causal op is timed
    and checked as language models run it: unpadded), its extra tensors and its call."""
    method: str
    causal: Tuple[bool, ...]
    causal_by_name: bool
    causal_padded: bool
    extras: Optional[Callable]
    call: Callable


FAMILIES: Dict[str, Family] = {
    "lln": Family("lln", (False, True), True, False, _lln_extras, _lln),
    "block": Family("softmax", (False, True), False, True, None, _block),
    "skyformer": Family("skyformer", (False,), False, True, None, _skyformer),
    "lavo": Family("lavo", (True, False), False, True, _lavo_extras, _lavo)}
PREFIXES = {"lln_": "lln", "block_softmax": "block", "nystrom_": "skyformer", "lavo_": "lavo"}


def family_of(kernel: str) -> str:
    """The family of a ``LAUNCH`` kernel name (or ``SPLIT_ROWS``: LLN's)."""
    return next((f for prefix, f in PREFIXES.items() if kernel.startswith(prefix)), "lln")


def inputs(family: str, b: int, n: int, dtype, device, heads: int = 12, d: int = 64, seed: int = 0) -> List:
    """q, k, v (B,H,N,D) leaves and the output gradient in ``dtype``, then the family's extra tensors: LLN's alpha
    (1,H,1,1) and beta, LAVO's bases (H,D,D) in ``dtype`` and bias (H,127) fp32."""
    gen = torch.Generator(device).manual_seed(seed)
    q, k, v, grad = (torch.randn(b, heads, n, d, generator=gen, device=device, dtype=dtype) for _ in range(4))
    extras = FAMILIES[family].extras
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad] + (
        extras(heads, dtype, device, gen) if extras else [])


def call(family: str, tensors: List, causal: bool, mask: Optional[Tensor], impl: str = "fused") -> Tensor:
    """The family's op on ``inputs``' tensors (the gradient left out) with ``impl``, or its float64 reference
    (``impl="reference"``, on float64 q, k, v)."""
    q, k, v, _, *extra = tensors
    return FAMILIES[family].call(q, k, v, extra, causal, mask, impl)

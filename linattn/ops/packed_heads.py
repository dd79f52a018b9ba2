"""Self-attention's q, k, v as views of one packed projection, and its gradient put back without a copy.

The module projects x (T,B,C) once into a (T,B,H,3,D) tensor: each head's q, k, v side by side, as Megatron-LM
packs them. ``split_heads`` gives q, k, v (B,H,T,D) as views of it, which the fused kernels read in place. Its
backward takes dq, dk, dv: where they are the three parts of one tensor laid out the same way (a fused backward
writes them so, ``triton/common.new_grads``), that tensor is the gradient, else the three are stacked into one.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


class _SplitHeads(torch.autograd.Function):
    """(T,B,H,3,D) -> q, k, v (T,B,H,D) views; backward: the packed gradient in place, or a stack."""

    @staticmethod
    def forward(ctx, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        ctx.shape = qkv.shape
        return qkv.unbind(3)

    @staticmethod
    def backward(ctx, dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]) -> Tensor:
        packed = packed_gradient(dq, dk, dv)
        if packed is not None:
            return packed
        like = next(g for g in (dq, dk, dv) if g is not None)
        return torch.stack([torch.zeros_like(like) if g is None else g for g in (dq, dk, dv)], 3)


def packed_gradient(dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]) -> Optional[Tensor]:
    """The (T,B,H,3,D) tensor whose parts dq, dk, dv (T,B,H,D) are, each head's three side by side in one storage
    (rows and heads contiguous across the three), or None."""
    if dq is None or dk is None or dv is None or torch.compiler.is_compiling():
        return None
    t, b, h, d = dq.shape
    strides = (b * h * 3 * d, h * 3 * d, 3 * d, 1)
    if not (dk.shape == dv.shape == dq.shape and all(_strided(g, strides) for g in (dq, dk, dv))
            and dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
            and dk.storage_offset() == dq.storage_offset() + d and dv.storage_offset() == dq.storage_offset() + 2 * d):
        return None
    return dq.as_strided((t, b, h, 3, d), (*strides[:3], d, 1), dq.storage_offset())


def _strided(x: Tensor, strides: Tuple[int, ...]) -> bool:
    return all(s == want for s, want, size in zip(x.stride(), strides, x.shape) if size > 1)


def split_heads(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """qkv (T,B,H,3,D) -> q, k, v (B,H,T,D), views of it."""
    return tuple(x.permute(1, 2, 0, 3) for x in _SplitHeads.apply(qkv))

"""Self-attention's q, k, v as views of one packed projection, and its gradient put back without a copy.

The module projects x (T,B,C) once into a (T,B,H,3,D) tensor: each head's q, k, v side by side, as Megatron-LM
packs them. ``split_heads`` gives q, k, v (B,H,T,D) as views of it, which the fused kernels read in place. Its
backward takes dq, dk, dv: where they are the three parts of one tensor laid out the same way (a fused backward
writes them so, ``triton/common.new_grads``), that tensor is the gradient, else the three are stacked into one.
The layout's definition (``head_stride``, ``packed_siblings``) lives here, torch only; the kernels import it.
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


class _PackedRows(torch.autograd.Function):
    """Three (H·D, ·) tensors (the projections' weights or biases) -> (3·H·D, ·), each head's three blocks of D rows
    side by side, (H, 3, D, ·); backward: the three gradients as views of one (3, H·D, ·) copy of the packed one
    (one copy, not one a part: each view is laid out as its parameter, so autograd keeps it as it is)."""

    @staticmethod
    def forward(ctx, heads: int, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        ctx.heads = heads
        return torch.stack([x.view(heads, -1, *x.shape[1:]) for x in (a, b, c)], 1).view(3 * a.shape[0], *a.shape[1:])

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = grad.view(ctx.heads, 3, -1, *grad.shape[1:]).transpose(0, 1).contiguous()  # (3, H, D, ·)
        return (None, *parts.view(3, -1, *grad.shape[1:]).unbind(0))


def pack_rows(heads: int, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """(3·H·D, ·) from three (H·D, ·) tensors, laid out (H, 3, D, ·): the weights (or biases) of the module's packed
    projection (``split_heads`` its output's q, k, v)."""
    return _PackedRows.apply(heads, a, b, c)


def packed_gradient(dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]) -> Optional[Tensor]:
    """The (T,B,H,3,D) tensor whose parts dq, dk, dv (T,B,H,D) are (``packed_siblings`` in one storage), or None."""
    if dq is None or dk is None or dv is None or torch.compiler.is_compiling():
        return None
    heads = [g.permute(1, 2, 0, 3) for g in (dq, dk, dv)]  # (B,H,T,D), as the ops see them
    if not (packed_siblings(*heads)
            and dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()):
        return None
    t, b, h, d = dq.shape
    return dq.as_strided((t, b, h, 3, d), (b * h * 3 * d, h * 3 * d, 3 * d, d, 1), dq.storage_offset())


def head_stride(x: Tensor) -> Optional[int]:
    """The head stride S >= X with which x (B,H,N,X) lies in fairseq's layout: (N,B,H,S) memory whose heads hold x
    in their first X columns (heads S apart, rows B*H*S apart). S = X: fairseq's own head split; S > X: one of
    tensors side by side in each head, as the module's packed projection gives q, k and v (S = 2D + Dv). None if x
    does not lie so."""
    b, h, n, c = x.shape
    sb, sh, sn, sc = x.stride()
    s = sh if h > 1 else sb if b > 1 else sn // b if n > 1 else c
    # the strides (H S, S, B H S, 1) along the dimensions longer than 1 (a step calls this a dozen times: no loop)
    if s < c or (b > 1 and sb != h * s) or (h > 1 and sh != s) or (n > 1 and sn != b * h * s) or (c > 1 and sc != 1):
        return None
    return s


def packed_siblings(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether q, k (B,H,N,D) and v (B,H,N,Dv) are the three parts of each head of one (N,B,H,2D+Dv) tensor, in
    that order, as the module's packed projection gives them (``head_stride``)."""
    d = q.shape[-1]
    return (head_stride(q) == 2 * d + v.shape[-1] and k.shape == q.shape and v.shape[:3] == q.shape[:3]
            and k.stride() == q.stride() == v.stride()
            and k.storage_offset() == q.storage_offset() + d and v.storage_offset() == k.storage_offset() + d)


def packs_grads(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a fused backward op writes dq, dk, dv into one tensor laid out as q, k, v's packed projection (its
    ``pack``): where they are ``packed_siblings``, outside ``torch.compile`` only. A compiled graph's op may be
    handed other buffers than it was traced with (Inductor gives an op's inputs storages of their own when it
    works out its outputs), so there an op's outputs must not depend on how its inputs alias."""
    return not torch.compiler.is_compiling() and packed_siblings(q, k, v)


def kept_alone(x: Tensor) -> Tensor:
    """x, or a contiguous copy of it if x is one part of a larger storage (as q, k, v of the module's packed
    projection): what an op keeps of x for its backward then holds x's own bytes only (under ``torch.compile`` the
    compiler decides what is kept: x as it is)."""
    if torch.compiler.is_compiling() or x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    return x.contiguous()


def split_heads(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """qkv (T,B,H,3,D) -> q, k, v (B,H,T,D), views of it."""
    return tuple(x.permute(1, 2, 0, 3) for x in _SplitHeads.apply(qkv))

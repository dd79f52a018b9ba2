"""LAVO's arguments: bases (H,r,D) with r <= D (and their orthogonal initialisation), pos_bias (H,2w-1), v's
head dim D (the memory lives in value space)."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv


def lavo_init_bases(num_heads: int, num_bases: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                    device=None) -> Tensor:
    """(H, r, D) bases, each head ``nn.init.orthogonal_`` (Saxe et al.): rows orthonormal as r <= D."""
    check_positive_int("num_heads", num_heads)
    check_positive_int("num_bases", num_bases)
    check_positive_int("head_dim", head_dim)
    if num_bases > head_dim:
        raise ValueError(f"num_bases must be <= head_dim = {head_dim} (orthogonal rows), got {num_bases}")
    bases = torch.empty(num_heads, num_bases, head_dim, dtype=torch.float32, device=device)
    for head in bases:
        torch.nn.init.orthogonal_(head)
    return bases.to(dtype)


def _check_value_dim(q: Tensor, v: Tensor, v_name: str) -> None:
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"{v_name} must have the head dim D = {q.shape[-1]} of q (the LAVO memory B ⊙ H "
                         f"is compared with q), got Dv = {v.shape[-1]}")


def _check_bases(bases: Tensor, num_heads: int, head_dim: int) -> None:
    if not isinstance(bases, Tensor) or not bases.is_floating_point():
        got = f"dtype {bases.dtype}" if isinstance(bases, Tensor) else type(bases).__name__
        raise ValueError(f"bases must be a floating-point tensor of shape (H, r, D), got {got}")
    if bases.dim() != 3 or bases.shape[0] != num_heads or bases.shape[2] != head_dim or bases.shape[1] < 1:
        raise ValueError(f"bases must have shape (H, r, D) = ({num_heads}, r, {head_dim}), got {tuple(bases.shape)}")
    if bases.shape[1] > head_dim:
        raise ValueError(f"bases must have r <= D = {head_dim} (orthogonal rows), got r = {bases.shape[1]}")


def _check_pos_bias(pos_bias: Tensor, num_heads: int, window: int) -> None:
    expected = (num_heads, 2 * window - 1)
    if not isinstance(pos_bias, Tensor) or not pos_bias.is_floating_point() or tuple(pos_bias.shape) != expected:
        got = tuple(pos_bias.shape) if isinstance(pos_bias, Tensor) else type(pos_bias).__name__
        raise ValueError(f"pos_bias must be a floating-point tensor of shape (H, 2w-1) = {expected} "
                         f"for window w = {window}, got {got}")


def _check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask) -> Tuple[int, Optional[Tensor]]:
    check_qkv(q, k, v)
    _check_value_dim(q, v, "v")
    window = check_positive_int("window", window)
    _check_bases(bases, q.shape[1], q.shape[-1])
    _check_pos_bias(pos_bias, q.shape[1], window)
    return window, check_key_padding_mask(key_padding_mask, k)


def _check_cross(q, k_src, v_src, bases, key_padding_mask) -> Optional[Tensor]:
    check_qkv(q, k_src, v_src, same_length=False)
    _check_value_dim(q, v_src, "v_src")
    _check_bases(bases, q.shape[1], q.shape[-1])
    return check_key_padding_mask(key_padding_mask, k_src)

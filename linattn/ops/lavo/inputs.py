"""LAVO's arguments: bases (H,r,D) with r <= D (and their orthogonal initialisation), pos_bias (H,2w-1), v's
head dim D (the memory lives in value space); the windows' real tokens and band bias, and ``LavoInputs``, what each
implementation's ``inputs`` gives."""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv


class LavoInputs(NamedTuple):
    """LAVO self-attention's inputs, as an implementation's ``inputs`` gives them; the fields it does not take are None
    (the tensors come first, then ``causal``).

    Both: q, k, v (B,H,N,D) unscaled and bases (H,r,D), in the compute dtype (``looped``) or their own (``parallel``,
    upcast inside: half is saved as half); bias (H,w,K) (``band_bias``) and tok (B,nw*w), 1 on the tokens of the
    memory (the real ones), in the compute dtype; causal.
    ``looped``: valid (B,nw*w) bool, the real tokens, or None when no key needs masking.
    ``parallel``: drop (B,1,nw,w,K), the window scores dropped, and keyless (B,1,nw,w,1), the queries with no key to
    see, bool.
    ``fused``: valid (B,nw*w) uint8, the real tokens; order (B,N) int32, each row's real-first order whose positions
    the windows count (the kernels read and write their rows through it), or None.

    A backward's gradients come in the same tuple (None where there is none).
    """
    q: Optional[Tensor] = None
    k: Optional[Tensor] = None
    v: Optional[Tensor] = None
    bases: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    tok: Optional[Tensor] = None
    valid: Optional[Tensor] = None
    drop: Optional[Tensor] = None
    keyless: Optional[Tensor] = None
    order: Optional[Tensor] = None
    causal: Optional[bool] = None


LAVO_TENSORS = LavoInputs._fields.index("causal")  # the tensor fields of ``LavoInputs``: the first ones


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


def check_bases(bases: Tensor, num_heads: int, head_dim: int) -> None:
    """Raise ``ValueError`` unless bases is a float (H, r, D) tensor with 1 <= r <= D."""
    if not isinstance(bases, Tensor) or not bases.is_floating_point():
        got = f"dtype {bases.dtype}" if isinstance(bases, Tensor) else type(bases).__name__
        raise ValueError(f"bases must be a floating-point tensor of shape (H, r, D), got {got}")
    if bases.dim() != 3 or bases.shape[0] != num_heads or bases.shape[2] != head_dim or bases.shape[1] < 1:
        raise ValueError(f"bases must have shape (H, r, D) = ({num_heads}, r, {head_dim}), got {tuple(bases.shape)}")
    if bases.shape[1] > head_dim:
        raise ValueError(f"bases must have r <= D = {head_dim} (orthogonal rows), got r = {bases.shape[1]}")


def check_pos_bias(pos_bias: Tensor, num_heads: int, window: int) -> None:
    """Raise ``ValueError`` unless pos_bias is a float (H, 2w-1) tensor."""
    expected = (num_heads, 2 * window - 1)
    if not isinstance(pos_bias, Tensor) or not pos_bias.is_floating_point() or tuple(pos_bias.shape) != expected:
        got = tuple(pos_bias.shape) if isinstance(pos_bias, Tensor) else type(pos_bias).__name__
        raise ValueError(f"pos_bias must be a floating-point tensor of shape (H, 2w-1) = {expected} "
                         f"for window w = {window}, got {got}")


def check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask) -> Tuple[int, Optional[Tensor]]:
    """Raise ``ValueError`` for a bad argument of LAVO self-attention; the window and the checked mask."""
    check_qkv(q, k, v)
    _check_value_dim(q, v, "v")
    window = check_positive_int("window", window)
    check_bases(bases, q.shape[1], q.shape[-1])
    check_pos_bias(pos_bias, q.shape[1], window)
    return window, check_key_padding_mask(key_padding_mask, k)


def check_cross(q, k_src, v_src, bases, key_padding_mask) -> Optional[Tensor]:
    """Raise ``ValueError`` for a bad argument of LAVO cross-attention; the checked mask."""
    check_qkv(q, k_src, v_src, same_length=False)
    _check_value_dim(q, v_src, "v_src")
    check_bases(bases, q.shape[1], q.shape[-1])
    return check_key_padding_mask(key_padding_mask, k_src)


def window_valid(q: Tensor, w: int, key_padding_mask: Optional[Tensor]) -> Tensor:
    """(B,nw*w) bool over nw = ceil(N/w) windows: True on the real tokens, False on padding and past N."""
    b, n = q.shape[0], q.shape[2]
    nw = -(-n // w)
    valid = torch.arange(nw * w, device=q.device).expand(b, nw * w) < n
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, nw * w - n), value=True)
    return valid


def band_bias(pos_bias: Tensor, w: int, causal: bool) -> Tensor:
    """(H,w,K): P[j - t + w - 1] for query slot t, key slot j inside the band, -inf outside (LAVO §3.3).

    Causal keys are [previous, own] window (K = 2w, offsets -w+1 .. 0, P[0 .. w-1] at key slots t+1 .. t+w);
    otherwise the own window (K = w). Row t is a slice of P, -inf padded: a Toeplitz matrix (unfold, rows flipped).
    """
    if causal:
        pos_bias = F.pad(pos_bias[:, :w], (w, w - 1), value=float("-inf"))
    return pos_bias.unfold(-1, 2 * w if causal else w, 1).flip(-2)

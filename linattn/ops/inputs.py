"""Argument checks shared by the ops: q, k, v (B,H,N,D), key padding masks (B,S), positive ints and scales.
Every error names the argument and what was expected."""
import functools
import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_length: bool = True) -> None:
    """q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv): 4-D, same batch/heads, same dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, N, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k, v must share (B, H) and k, v the key length: got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim D, got {q.shape[-1]} and {k.shape[-1]}")
    if same_length and q.shape[2] != k.shape[2]:
        raise ValueError(f"self-attention needs q and k of the same length N, got {q.shape[2]} and {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}")


def check_key_padding_mask(mask: Optional[Tensor], k: Tensor) -> Optional[Tensor]:
    """Validate a (B, S) bool mask (True = padding) against k (B,H,S,D); returns it as bool or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.shape != (k.shape[0], k.shape[2]):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"key_padding_mask must have shape (B, S) = {(k.shape[0], k.shape[2])}, got {shape}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            raise ValueError(f"key_padding_mask must be bool or integer (True/1 = padding), got dtype {mask.dtype}")
        mask = mask.bool()
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask must be on {k.device}, got {mask.device}")
    return mask


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_positive_scale(name: str, value, q: Tensor) -> Tensor:
    """A float or a tensor broadcastable to (B, H, 1, 1), all finite and > 0 (a tensor's values checked on its device,
    with ``torch._assert_async``: no host sync); returned as a float32 tensor on q's device (float64 for float64
    q)."""
    return check_positive_scales(q, **{name: value})[0]


def check_positive_scales(q: Tensor, *, per_head: bool = False, **scales) -> Tuple[Tensor, ...]:
    """``check_positive_scale`` of each named scale, the values of those given as tensors checked by one device
    assertion (four launches, whatever their number). A forward runs this every time: the shapes are checked by hand
    once per shape (``_scale_shape``; ``torch.broadcast_shapes`` costs the host more than the rest). ``per_head``:
    where every scale is a tensor (none learnt), each is returned as a contiguous (B, H, 1, 1) part of one stack,
    which is what the assertion checks (the fused kernels read one value a head: no stack of their own)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads = q.shape[:2]
    compiling = torch.compiler.is_compiling()  # traced once: the functions themselves (Dynamo warns of a cache)
    scale_shape, message = (_scale_shape.__wrapped__, _message.__wrapped__) if compiling else (_scale_shape, _message)
    checked, on_device = [], []
    for name, value in scales.items():
        t = value
        if not (isinstance(value, Tensor) and value.dtype == dtype and value.device == q.device):
            t = torch.as_tensor(value, dtype=dtype, device=q.device)
        shape = scale_shape(name, t.shape, heads)
        t4 = t if t.dim() == 4 else t.reshape(shape)
        if not isinstance(value, Tensor):
            if not (math.isfinite(float(value)) and float(value) > 0):  # a Python number: checked on the host
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        else:
            on_device.append((name, t4))
        checked.append(t4)
    if on_device:  # checked on the device, no host sync (RuntimeError with this text)
        names = message(tuple(name for name, _ in on_device))
        if per_head and len(on_device) == len(checked) and not any(t.requires_grad for t in checked):
            full = (*heads, 1, 1)
            t = torch.stack([t if t.shape == full else t.expand(full) for t in checked])
            checked = list(t.unbind(0))
        else:
            t = on_device[0][1] if len(on_device) == 1 else torch.cat([t.detach().reshape(-1) for _, t in on_device])
        torch._assert_async(t.detach().nan_to_num(0.0, 0.0).gt(0).all(), names)  # NaN and inf made 0: not > 0
    return tuple(checked)


@functools.lru_cache(maxsize=1024)
def _scale_shape(name: str, shape: torch.Size, heads: torch.Size) -> Tuple[int, ...]:
    """The 4-D shape (B|1, H|1, 1, 1) a scale named ``name`` of ``shape`` takes against q's (B, H) ``heads``; a
    ValueError naming it where it is not broadcastable to (B, H, 1, 1)."""
    if len(shape) > 4:
        raise ValueError(f"{name} must be a float or broadcastable to (B, H, 1, 1), got shape {tuple(shape)}")
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    if any(s != 1 and n != 1 and s != n for s, n in zip(shape4[:2], heads)):
        raise ValueError(f"{name} must be broadcastable to (B, H, 1, 1) = {(heads[0], heads[1], 1, 1)}, "
                         f"got shape {tuple(shape)}")
    if shape4[-1] != 1 or shape4[-2] != 1:
        raise ValueError(f"{name} must be broadcastable to (B, H, 1, 1), got shape {tuple(shape)}")
    return shape4


@functools.lru_cache(maxsize=64)
def _message(names: Tuple[str, ...]) -> str:
    """The device assertion's message for the scales ``names``."""
    return " or ".join(f"{name} must be finite and > 0" for name in names)

"""Argument validation and precision rules shared by the ops: every error names the argument and
what was expected."""
import functools
from typing import Optional, Union

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
    """A float or a tensor broadcastable to (B, H, 1, 1), all > 0; returned as a float32 tensor on q's device."""
    t = torch.as_tensor(value, dtype=torch.float32 if q.dtype != torch.float64 else torch.float64, device=q.device)
    if t.dim() > 4:
        raise ValueError(f"{name} must be a float or broadcastable to (B, H, 1, 1), got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    try:
        torch.broadcast_shapes(t4.shape, (q.shape[0], q.shape[1], 1, 1))
    except RuntimeError:
        raise ValueError(f"{name} must be broadcastable to (B, H, 1, 1) = {(q.shape[0], q.shape[1], 1, 1)}, "
                         f"got shape {tuple(t.shape)}") from None
    if t4.shape[-1] != 1 or t4.shape[-2] != 1:
        raise ValueError(f"{name} must be broadcastable to (B, H, 1, 1), got shape {tuple(t.shape)}")
    if not bool(torch.all(t4 > 0)) or not bool(torch.all(torch.isfinite(t4))):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return t4


def compute_dtype(x: Tensor) -> torch.dtype:
    """Half inputs compute in float32; float32/float64 compute in their own precision."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


Rows = Union[None, int, Tensor]


def select_rows(rows: Rows, n: int, device: torch.device) -> Tensor:
    """Row indices (R,) from None (all n), an int (that many evenly spaced rows) or a 1-D LongTensor."""
    if rows is None:
        return torch.arange(n, device=device)
    if isinstance(rows, int) and not isinstance(rows, bool):
        if rows < 1:
            raise ValueError(f"rows must be a positive int or a 1-D LongTensor of row indices, got {rows}")
        return torch.linspace(0, n - 1, min(rows, n), device=device).round().long().unique()
    if (not isinstance(rows, Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)
            or rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"rows must be a positive int or a non-empty 1-D LongTensor of indices in [0, {n}), "
                         f"got {rows!r}")
    return rows.to(device=device, dtype=torch.long)


def allowed_keys(index: Tensor, s: int, *, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    """(B or 1, 1, R, S) bool: True where query row ``index[r]`` may see key j (j <= index[r] if causal, not padded)."""
    j = torch.arange(s, device=index.device)
    allowed = (j[None, :] <= index[:, None]) if causal else torch.ones(len(index), s, dtype=torch.bool,
                                                                          device=index.device)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return allowed


def masked_softmax(scores: Tensor, allowed: Optional[Tensor] = None) -> Tensor:
    """Softmax over the last dim restricted to ``allowed`` (bool, broadcastable; None: all).

    Rows with nothing allowed (or only -inf scores) give 0, never NaN; a NaN score stays NaN.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.detach().amax(-1, keepdim=True)  # the shift cancels exactly: no gradient needed
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)


def autocast_off(op):
    """Run ``op`` with autocast off on the device of its first argument.

    Under ``torch.autocast`` (fairseq's ``--amp``) matmuls run in fp16/bf16 even after an op has
    upcast its inputs: the features and sums an op computes in float32 would be rounded to half.
    With autocast off each op computes as documented (half inputs in float32, output in their dtype).
    """
    @functools.wraps(op)
    def run(q, *args, **kwargs):
        device_type = q.device.type if isinstance(q, Tensor) else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            return op(q, *args, **kwargs)

    return run

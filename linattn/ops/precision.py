"""Precision rules of the ops: half inputs compute in float32, and autocast is off inside every op."""
import functools

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """Half inputs compute in float32; float32/float64 compute in their own precision."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def has_autocast(device_type: str) -> bool:
    """Whether autocast exists on ``device_type`` (not on ``meta``). Under ``torch.compile`` it is not asked:
    Dynamo cannot trace ``torch._C._is_autocast_available`` before torch 2.12 (a graph break in every op), and a
    traced op runs on a real device, where autocast exists."""
    return torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)


def autocast_off(op):
    """Run ``op`` with autocast off on the device of its first argument.

    Under ``torch.autocast`` (fairseq's ``--amp``) matmuls run in fp16/bf16 even after an op has
    upcast its inputs: the features and sums an op computes in float32 would be rounded to half.
    With autocast off each op computes as documented (half inputs in float32, output in their dtype). Where it is
    off already (no ``torch.autocast`` around the call, as in fp32 and ``--fp16`` training) the op runs as it is: the
    context costs the host about 5 µs a call, and a fused step calls two or three ops.
    """
    @functools.wraps(op)
    def run(q, *args, **kwargs):
        device_type = q.device.type if isinstance(q, Tensor) else "cpu"
        if not has_autocast(device_type):  # the meta device: no autocast to turn off
            return op(q, *args, **kwargs)
        if not torch.compiler.is_compiling() and not torch.is_autocast_enabled(device_type):
            return op(q, *args, **kwargs)
        with torch.autocast(device_type=device_type, enabled=False):
            return op(q, *args, **kwargs)

    return run


def function_output(out: Tensor, dtype: torch.dtype) -> Tensor:
    """What an op's ``autograd.Function.forward`` returns: ``out`` in ``dtype``; under ``torch.compile`` a copy
    that aliases no other value of the forward and that no op has written in place. torch 2.11 (pytorch#180642)
    gives the compiled Function a second output for such an alias (a ``.to`` to the same dtype, or a buffer
    written with ``out=``) and routes the output's gradient to it: every input gradient comes out wrong. The copy is
    ``slice_copy``'s (the whole tensor, contiguous): ``to(copy=True)`` keeps a dense input's strides, so Dynamo
    would guard on whether an output sliced from padded rows is contiguous (a length on the block or window grid
    would compile a second graph), and a ``clone`` or a copy into a new buffer brings the wrong gradients back on
    2.11."""
    if torch.compiler.is_compiling():
        return torch.slice_copy(out.to(dtype))
    return out.to(dtype)

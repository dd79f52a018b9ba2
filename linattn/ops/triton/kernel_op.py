"""How the kernels' wrappers become PyTorch ops (``linattn::name``), which ``torch.compile``, the meta device and a
``TorchDispatchMode`` (the op counter) see as one op each.

``torch.library.custom_op`` would register the same op, but each call then runs its Python autograd wrapper and
Dynamo's disable wrapper, about three times the host time of a call through ``torch.library.Library``
(docs/benchmarks.md § Host time), and a fused step calls five to ten. The ops are called inside the methods'
``autograd.Function`` s (no gradient flows through them), so they have no autograd kernel.
"""
from typing import Callable, Sequence

import torch

_LIBRARY = torch.library.Library("linattn", "FRAGMENT")
DEVICES = ("CUDA", "CPU")  # the CPU: the kernels under Triton's interpreter (the tests)


def kernel_op(name: str, mutates_args: Sequence[str] = ()) -> Callable[[Callable], torch._ops.OpOverload]:
    """``@kernel_op(name)`` on fn: fn (type-annotated) registered as the op ``linattn::name`` (schema inferred,
    ``mutates_args`` the arguments it writes) and its kernel on ``DEVICES``; returns the op
    (``torch.ops.linattn.name.default``, called as fn is). Its fake (meta) kernel:
    ``@torch.library.register_fake(op)``."""
    def register(fn: Callable) -> torch._ops.OpOverload:
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        for device in DEVICES:
            _LIBRARY.impl(name, fn, device)
        return getattr(torch.ops.linattn, name).default
    return register

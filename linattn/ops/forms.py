"""The two execution forms of every linear op (docs/design.md §1.5).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU form (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU form;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...).
"""
import contextlib

import torch

IMPLS = ("auto", "parallel", "looped")
_AUTO_ON_CPU = ["looped"]


def resolve_impl(impl: str, device: torch.device) -> str:
    """``parallel`` or ``looped`` for an op's ``impl`` argument on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return _AUTO_ON_CPU[-1] if torch.device(device).type == "cpu" else "parallel"
    return impl


@contextlib.contextmanager
def auto_on_cpu(impl: str):
    """Inside the block ``auto`` means ``impl`` on the CPU: runs modules built with ``auto`` in either form."""
    if impl not in IMPLS[1:]:
        raise ValueError(f"impl must be parallel or looped, got {impl!r}")
    _AUTO_ON_CPU.append(impl)
    try:
        yield
    finally:
        _AUTO_ON_CPU.pop()

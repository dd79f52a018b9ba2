"""The two execution forms of every linear op (docs/design.md §1.5).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU form (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU form;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...).
"""
import torch

IMPLS = ("auto", "parallel", "looped")


def resolve_impl(impl: str, device: torch.device) -> str:
    """``parallel`` or ``looped`` for an op's ``impl`` argument on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "looped" if torch.device(device).type == "cpu" else "parallel"
    return impl

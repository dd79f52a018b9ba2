"""The implementations of every linear op, chosen by its ``impl`` argument (docs/design.md §1.3).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU implementation (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU implementation;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...).

Every method's package holds one file per implementation (``<method>/parallel.py``, ``<method>/looped.py``), each
with the same two functions over the method's named tuple of inputs: ``forward(x) -> (out, saved)`` and
``backward(x, saved, grad) -> grads``; the method's ``autograd.py`` holds one autograd Function that picks the
file from its table ``{impl: module}``. Adding an implementation: one file per method, its name in ``IMPLS``
and one entry in each method's table.
"""
import contextlib

import torch

IMPLS = ("auto", "parallel", "looped")  # what an op's ``impl`` (and ``--attention-impl``) accepts
_AUTO = {}  # the implementation ``auto`` resolves to on every device, set by ``auto_impl``


def resolve_impl(impl: str, device: torch.device) -> str:
    """``parallel`` or ``looped`` for an op's ``impl`` argument on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return _AUTO.get("auto") or ("looped" if torch.device(device).type == "cpu" else "parallel")
    return impl


@contextlib.contextmanager
def auto_impl(impl: str):
    """Inside, ``auto`` resolves to ``impl`` on every device: tests run one implementation through modules built
    with the default ``attention_impl``."""
    if impl not in IMPLS[1:]:
        raise ValueError(f"impl must be one of {', '.join(IMPLS[1:])}, got {impl!r}")
    _AUTO["auto"] = impl
    try:
        yield
    finally:
        _AUTO.pop("auto")

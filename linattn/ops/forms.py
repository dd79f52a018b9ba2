"""The two execution forms of every linear op (docs/design.md §1.3).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU form (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU form;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...).
"""
import contextlib

import torch

IMPLS = ("auto", "parallel", "looped")
_AUTO = {}  # impl -> the form ``auto`` resolves to on every device, set by ``auto_form``


def resolve_impl(impl: str, device: torch.device) -> str:
    """``parallel`` or ``looped`` for an op's ``impl`` argument on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return _AUTO.get("auto") or ("looped" if torch.device(device).type == "cpu" else "parallel")
    return impl


@contextlib.contextmanager
def auto_form(form: str):
    """Inside, ``auto`` resolves to ``form`` on every device: tests run one form through modules built with the
    default ``attention_impl``."""
    if form not in ("parallel", "looped"):
        raise ValueError(f"form must be parallel or looped, got {form!r}")
    _AUTO["auto"] = form
    try:
        yield
    finally:
        _AUTO.pop("auto")

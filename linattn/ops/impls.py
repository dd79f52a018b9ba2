"""The implementations of every linear op, chosen by its ``impl`` argument (docs/design.md §1.3).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU implementation (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU implementation;
- ``fused``: Triton kernels registered as PyTorch custom ops (``ops/triton/``), for the methods with a
  ``<method>/fused.py``; elsewhere, and on a device, dtype or shape its kernels cannot take, ``parallel`` runs;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...) and under ``torch.compile``.
  It does not pick ``fused`` yet: its kernels are correct on an H100, and faster than ``parallel`` there for causal
  LLN, but the non-causal step has not been measured at its tuned settings; ``fused`` is taken when asked for
  (docs/design.md §1.3.1).

Every method's package holds one file per implementation (``<method>/parallel.py``, ``<method>/looped.py``), each
with the same two functions over the method's named tuple of inputs: ``forward(x) -> (out, saved)`` and
``backward(x, saved, grad) -> grads``; the method's ``autograd.py`` holds one autograd Function that picks the
file from its table ``{impl: module}``. Adding an implementation: one file per method, its name in ``IMPLS``
and one entry in each method's table. Which implementation a call runs: ``implementation_for``.
"""
import contextlib
import functools
import importlib
import importlib.util
import os
from typing import Collection, Mapping, Optional, Union

import torch
from torch import Tensor

IMPLS = ("auto", "parallel", "looped", "fused")  # what an op's ``impl`` (and ``--attention-impl``) accepts
BASE = ("parallel", "looped")  # the implementations every method has
_AUTO = {}  # the implementation ``auto`` resolves to on every device, set by ``auto_impl``


_TRITON = importlib.util.find_spec("triton") is not None  # looked up once, without importing it


def triton_available() -> bool:
    """Whether Triton can be imported (the ``fused`` kernels import it lazily)."""
    return _TRITON


def fused_devices() -> tuple:
    """The device types the fused kernels run on: CUDA, meta (their fake kernels), and the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``, the tests)."""
    return ("cuda", "meta", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda", "meta")


def device_shared_memory(device: torch.device) -> Optional[int]:
    """The shared memory one block of a kernel may use on ``device`` (bytes: CUDA's opt-in limit per block; 0 where
    this torch does not say), None off CUDA (meta, Triton's interpreter: no limit to check)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory(index: int) -> int:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)


def fits_shared_memory(device: torch.device, need_kib: Mapping[int, int], head_dim: int) -> bool:
    """Whether a method's kernels fit ``device`` at ``head_dim``: ``need_kib`` maps the largest head dim of each
    size class to the shared memory (KiB) of the method's largest kernel block there, as compiled for sm_90 (the
    slow tier checks them); an A100 gives 163 KiB a block, an H100 227, consumer GPUs about 100."""
    limit = device_shared_memory(device)
    need = next((kib for dim, kib in sorted(need_kib.items()) if head_dim <= dim), None)
    return limit is None or (need is not None and need * 1024 <= limit)


def resolve_impl(impl: str, device: torch.device, available: Collection[str] = BASE) -> str:
    """The implementation an op's ``impl`` argument runs on ``device`` among a method's ``available`` ones
    (``parallel`` and ``looped`` always; ``fused`` where the method has it): ``fused`` asked where the method or
    the device cannot take it is ``parallel``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    kind = torch.device(device).type
    fused_ok = "fused" in available and triton_available() and kind in fused_devices()
    if impl == "auto":  # under torch.compile: parallel (the looped implementation's loops would be unrolled)
        impl = _AUTO.get("auto") or ("looped" if kind == "cpu" and not torch.compiler.is_compiling() else "parallel")
    return "parallel" if impl == "fused" and not fused_ok else impl


def implementation_for(method_or_table: Union[str, Mapping], impl: str, q: Tensor, v: Optional[Tensor] = None,
                       **options) -> str:
    """The implementation an op call with ``impl`` runs for query (and value) tensors like ``q`` (``v``): the
    method's table ``{impl: module}`` (or its registry name) resolved on q's device, and ``fused`` only where its
    module ``supports(q, v, **options)`` (dtype, head sizes, the method's options such as LLN's ``chunk``), else
    ``parallel``; ``only`` for an op with one implementation
    (the softmax baseline, SDPA). The benchmarks and the self-test print it."""
    table = method_or_table
    if isinstance(method_or_table, str):
        if importlib.util.find_spec(f"linattn.ops.{method_or_table}.autograd") is None:
            return "only"
        # a method without a table of its own (LLN+Diag: its parts') has the base implementations
        table = getattr(importlib.import_module(f"linattn.ops.{method_or_table}.autograd"), "IMPLEMENTATIONS",
                        dict.fromkeys(BASE))
    resolved = resolve_impl(impl, q.device, available=tuple(table))
    if resolved == "fused" and not table["fused"].supports(q, q if v is None else v, **options):
        return "parallel"
    return resolved


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

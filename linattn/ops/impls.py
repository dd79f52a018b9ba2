"""The implementations of every linear op, chosen by its ``impl`` argument (docs/design.md §1.3).

- ``parallel``: a number of batched tensor ops that does not grow with the length (beyond a log term), no host
  sync: the GPU implementation (each ATen op is at least one kernel launch there);
- ``looped``: passes over cache-sized chunks and row groups: the fast CPU implementation;
- ``fused``: Triton kernels registered as PyTorch custom ops (``ops/triton/``), for the methods with a
  ``<method>/fused.py``; a method without one runs ``parallel``;
- ``auto``: ``looped`` on the CPU, ``parallel`` on any other device (CUDA, meta, ...) and under ``torch.compile``.
  It does not pick ``fused`` yet: its kernels are correct on an H100, and faster than ``parallel`` there for causal
  LLN, but the non-causal step has not been measured at its tuned settings; ``fused`` is taken when asked for
  (docs/design.md §1.3.1).

Every method's package holds one file per implementation (``<method>/parallel.py``, ``<method>/looped.py``), each
with the same two functions over the method's named tuple of inputs: ``forward(x) -> (out, saved)`` and
``backward(x, saved, grad) -> grads``; the method's ``autograd.py`` holds one autograd Function that picks the
file from its table ``{impl: module}``. A file whose kernels have limits declares them: ``SUPPORT`` (a
``Support``: dtypes, devices, causality, head sizes, elements, shared memory) and ``not_supported_reasons(q, v,
**options) -> List[str]``, which adds its method's own limits (LLN's causal chunk, LAVO's window, ...); ``parallel``
and ``looped`` run every call and declare nothing. What a file does differently from the others is a flag of its
own, read through the table (``declares``: ``READS_REAL_FIRST``, its kernels read the rows through each row's
real-first order) or a function of its own (LLN's ``token_moments``). An implementation asked for by name that
cannot run a call is refused with its reasons (``ImplementationError``), never replaced; ``auto`` chooses among
those that can. Adding an implementation: one file per method, its name in ``IMPLS`` and one entry in each
method's table. Which implementation a call runs: ``implementation_for``; why: ``choose``.
"""
import contextlib
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Collection, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

# what an op's ``impl`` (and ``--attention-impl``) accepts; absolute, so that ``ops`` also loads as a package of its
# own (dev.perf.compare_ops loads a commit's ops that way)
from linattn.implementations import IMPLS

BASE = ("parallel", "looped")  # the implementations every method has, which run every call
_AUTO = {}  # the implementation ``auto`` resolves to on every device, set by ``auto_impl``


_TRITON = importlib.util.find_spec("triton") is not None  # looked up once, without importing it


def triton_available() -> bool:
    """Whether Triton can be imported (the ``fused`` kernels import it lazily)."""
    return _TRITON


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


def _names(dtypes) -> str:
    return ", ".join(str(t).replace("torch.", "") for t in dtypes)


@dataclass(frozen=True)
class Support:
    """What an implementation's kernels take, declared once in its file as ``SUPPORT`` (in the spirit of xformers'
    fmha ``AttentionOpBase``), and the ``reasons`` a call falls outside. Not declared, as every implementation takes
    them: a key padding mask, and ``torch.compile`` (the fused kernels are custom ops with fake kernels)."""

    dtypes: Tuple[torch.dtype, ...]  # q's dtype; v's must be q's
    devices: Tuple[str, ...]  # the device types the kernels run on; besides: meta (their fake kernels), and the
    # CPU for Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, the tests)
    triton: bool  # Triton kernels: Triton must be installed
    causal: bool  # runs causal attention too
    max_head_dim: int  # the largest D and Dv: a kernel holds its rows in registers
    max_elements: int  # the most elements in q and in v: the kernels index with int32
    shared_memory_kib: Mapping[int, int]  # the largest head dim of each size class -> the shared memory (KiB) of
    # the largest kernel block there, as compiled for sm_90 (the slow tier checks them); an A100 gives 163 KiB a
    # block, an H100 227, consumer GPUs about 100

    def device_types(self) -> Tuple[str, ...]:
        """The device types a call may be on (read at each call: TRITON_INTERPRET may be set after import)."""
        interpreted = self.triton and os.environ.get("TRITON_INTERPRET") == "1"
        return self.devices + ("meta",) + (("cpu",) if interpreted else ())

    def reasons(self, q: Tensor, v: Tensor, *, causal: bool = False, device: Optional[torch.device] = None
                ) -> List[str]:
        """Why the kernels cannot take queries like q (B,H,N,D) and values like v (B,H,S,Dv), causal if ``causal``,
        each a short sentence naming the value and the limit; [] where they can. On q's device, or on ``device`` for
        a stand-in q on the meta device (the plugin's check of a model before the trainer places it: the GPU, and
        so its shared memory, is not known yet)."""
        kind = q.device.type if device is None else torch.device(device).type
        reasons = []
        if q.dtype not in self.dtypes:
            reasons.append(f"dtype {q.dtype} not in ({_names(self.dtypes)})")
        if v.dtype != q.dtype:
            reasons.append(f"values' dtype {v.dtype} is not the queries' {q.dtype}")
        if self.triton and not triton_available():
            reasons.append("Triton is not installed")
        if kind not in self.device_types():
            interpreter = " (cpu only under TRITON_INTERPRET=1)" if self.triton else ""
            reasons.append(f"device {kind}: the fused kernels run on {', '.join(self.devices)}{interpreter}")
        if causal and not self.causal:
            reasons.append("causal: the kernels run non-causal attention only")
        dim = max(q.shape[-1], v.shape[-1])
        if dim > self.max_head_dim:
            reasons.append(f"head dim {dim} > {self.max_head_dim} (held in registers)")
        for name, t in (("q", q), ("v", v)):
            if t.numel() > self.max_elements:
                reasons.append(f"{t.numel()} elements in {name} > {self.max_elements} (int32 indices)")
        return reasons + (self._shared_memory(q.device, dim) if device is None else [])

    def _shared_memory(self, device: torch.device, head_dim: int) -> List[str]:
        """The kernels' largest block at ``head_dim`` against ``device``'s shared memory per block (none off CUDA;
        a head dim beyond the table is ``reasons``' own)."""
        limit = device_shared_memory(device)
        need = next((kib for dim, kib in sorted(self.shared_memory_kib.items()) if head_dim <= dim), None)
        if limit is None or need is None or need * 1024 <= limit:
            return []
        return [f"head dim {head_dim} needs {need} KiB of shared memory a block, {device} gives {limit // 1024}"]


class ImplementationError(ValueError):
    """An implementation asked for by name cannot run a call: ``reasons`` says why."""

    def __init__(self, impl: str, module, reasons: List[str]):
        self.impl, self.reasons = impl, reasons
        super().__init__(f"impl {impl!r} cannot run this call ({module.__name__}): {'; '.join(reasons)}; impl "
                         f"{', '.join(('auto',) + BASE[:-1])} or {BASE[-1]} run any call")


def choose(impl: str, device: torch.device, available: Collection[str] = BASE, compiling: Optional[bool] = None
           ) -> Tuple[str, str]:
    """The implementation an op's ``impl`` names on ``device`` among a method's ``available`` ones, and why in a few
    words: ``auto`` is ``looped`` on the CPU and ``parallel`` elsewhere and under ``torch.compile`` (``compiling``:
    whether the call is compiled; by default whether it is being compiled now); a name the method has no
    implementation of runs ``parallel``. Whether that implementation takes the call: ``implementation_for``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    kind = torch.device(device).type
    compiling = torch.compiler.is_compiling() if compiling is None else compiling
    why = "asked for"
    if impl == "auto":  # compiled: parallel (the looped implementation's loops would be unrolled)
        why = "auto set by auto_impl" if _AUTO else "auto under torch.compile" if compiling else f"auto on {kind}"
        impl = _AUTO.get("auto") or ("looped" if kind == "cpu" and not compiling else "parallel")
    if impl not in available:
        return "parallel", f"{why}: the method has no {impl!r} implementation"
    return impl, why


def resolve_impl(impl: str, device: torch.device, available: Collection[str] = BASE) -> str:
    """``choose``'s implementation (without why)."""
    return choose(impl, device, available)[0]


def table_of(method_or_table: Union[str, Mapping]) -> Optional[Mapping]:
    """A method's table ``{impl: module}``: the one given, or its op's ``IMPLEMENTATIONS`` by its registry name; None
    for an op with one implementation (the softmax baseline, SDPA)."""
    if not isinstance(method_or_table, str):
        return method_or_table
    if importlib.util.find_spec(f"linattn.ops.{method_or_table}.autograd") is None:
        return None
    # a method without a table of its own has the base implementations
    return getattr(importlib.import_module(f"linattn.ops.{method_or_table}.autograd"), "IMPLEMENTATIONS",
                   dict.fromkeys(BASE))


def unsupported_reasons(method_or_table: Union[str, Mapping], impl: str, q: Tensor, v: Optional[Tensor] = None,
                        **options) -> List[str]:
    """Why the implementation ``impl`` names (``choose``) cannot run a call with tensors like q (and v), by its
    file's ``not_supported_reasons(q, v, **options)``; [] where it can, or has no limits."""
    table = table_of(method_or_table)
    if table is None:
        return []
    return _reasons(table[resolve_impl(impl, q.device, available=tuple(table))], q, v, options)


def _reasons(implementation, q: Tensor, v: Optional[Tensor], options: dict) -> List[str]:
    """``unsupported_reasons`` of the implementation's file (a resolved one)."""
    check = getattr(implementation, "not_supported_reasons", None)
    return [] if check is None else check(q, q if v is None else v, **options)


def implementation_for(method_or_table: Union[str, Mapping], impl: str, q: Tensor, v: Optional[Tensor] = None,
                       **options) -> str:
    """The implementation an op call with ``impl`` runs for query (and value) tensors like ``q`` (``v``) and the
    method's ``options`` (causal, LLN's ``chunk``, ...): ``choose``'s among the method's table ``{impl: module}`` (or
    its registry name) on q's device, where it takes the call (``unsupported_reasons``). Asked for by name, one that
    cannot is refused (``ImplementationError``, naming why); ``auto``'s runs ``parallel`` instead. ``only`` for an
    op with one implementation (the softmax baseline, SDPA). The benchmarks and the self-test print it."""
    table = table_of(method_or_table)
    if table is None:
        return "only"
    resolved, reasons = _decision(table, impl, q, v, options)
    if not reasons:
        return resolved
    if impl == "auto":
        return "parallel"
    raise ImplementationError(impl, table[resolved], list(reasons))


# ``implementation_for``'s decisions: key (``_decision``) -> (table, its resolved file, resolved name, reasons)
_DECISIONS: Dict[tuple, tuple] = {}
_MAX_DECISIONS = 4096  # shapes met (a training run's lengths vary): cleared whole when full


def _decision(table: Mapping, impl: str, q: Tensor, v: Optional[Tensor], options: dict) -> Tuple[str, tuple]:
    """(the resolved implementation, why its file cannot take the call: () where it can), worked out once per
    table, ``impl``, q's and v's shapes, dtypes and device, options and what else the reasons read (the
    ``TRITON_INTERPRET`` variable, ``auto_impl``, whether Triton is installed, the device's shared memory): a forward
    asks two or three times (the matcher, its rows, the op), each once. Not kept under ``torch.compile`` (compiled
    once; ``choose`` reads the compiler's state) nor for options that cannot be a key."""
    if torch.compiler.is_compiling():
        resolved = resolve_impl(impl, q.device, available=tuple(table))
        return resolved, tuple(_reasons(table[resolved], q, v, options))
    w = q if v is None else v
    key = (id(table), impl, q.shape, q.dtype, q.device, w.shape, w.dtype, *options.items(),
           os.environ.get("TRITON_INTERPRET"), _AUTO.get("auto"), triton_available(), device_shared_memory(q.device))
    try:
        entry = _DECISIONS.get(key)
    except TypeError:  # an option that is no key
        resolved = resolve_impl(impl, q.device, available=tuple(table))
        return resolved, tuple(_reasons(table[resolved], q, v, options))
    # the entry holds its table (whose id then stays its own) and checks that the table still holds the same file
    if entry is not None and entry[0] is table and table.get(entry[2]) is entry[1]:
        return entry[2], entry[3]
    resolved = resolve_impl(impl, q.device, available=tuple(table))
    reasons = tuple(_reasons(table[resolved], q, v, options))
    if len(_DECISIONS) >= _MAX_DECISIONS:
        _DECISIONS.clear()
    _DECISIONS[key] = (table, table[resolved], resolved, reasons)
    return resolved, reasons


def declares(table: Mapping, impl: str, flag: str) -> bool:
    """Whether the file of the implementation ``impl`` (resolved) in a method's table sets ``flag`` (absent:
    False), e.g. ``READS_REAL_FIRST``."""
    return bool(getattr(table[impl], flag, False))


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

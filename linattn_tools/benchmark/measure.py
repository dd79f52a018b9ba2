"""Time, peak memory and the machine they were measured on (CPU or CUDA, same calls).

Time: wall clock of one ``fn()`` (the sweep takes the median of repeats after warm-up); on CUDA
between events, the device synchronised. Memory: peak bytes *allocated by tensors* during one call, above
what was allocated before it (inputs and parameters excluded; gradients, activations, temporaries
and workspaces included). On CPU it is the running sum of the allocator's alloc/free events recorded
by ``torch.profiler(profile_memory=True)``; on CUDA ``torch.cuda.max_memory_allocated``.
"""
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..malloc import KEEP_FREED_MEMORY


def elapsed_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one ``fn()`` (CUDA: between two events, waiting for the second)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:  # allocations are > 0, frees < 0
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak tensor bytes allocated during ``fn()`` above those live before it (see the module doc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _cpu_peak_bytes(fn)


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 2048,
                            repeats: int = 5) -> float:
    """Best rate of a (size × size) @ (size × size) matmul: the denominator of the FLOP floors."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = min(elapsed_seconds(lambda: a @ b, device) for _ in range(repeats))
    return 2 * size ** 3 / best


# --malloc keep: linattn_tools/malloc.py (the effect PyTorch's CPU tuning guides get from jemalloc/tcmalloc),
# applied to every method alike, SDPA included


def own_command() -> List[str]:
    """How this process's tool was started, without its options: ``["-m", module]`` for ``python -m module``
    (the way every tool starts), else the script's path."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None or not spec.name:
        return [sys.argv[0]]
    name = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
    return ["-m", name]


def restart_keeping_freed_memory(argv: Sequence[str]) -> None:
    """Re-execute this tool (``argv``: its ``sys.argv``) with ``KEEP_FREED_MEMORY`` in the environment,
    unless already set.

    Only on glibc (the variables mean nothing elsewhere); returns when there is nothing to do.
    """
    if platform.libc_ver()[0] != "glibc" or all(os.environ.get(k) == v for k, v in KEEP_FREED_MEMORY.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *own_command(), *argv[1:]], {**os.environ, **KEEP_FREED_MEMORY})


def allocator_setting() -> Optional[str]:
    """The glibc malloc variables of this process (None when unset): recorded with the results."""
    found = [f"{k}={os.environ[k]}" for k in KEEP_FREED_MEMORY if k in os.environ]
    return " ".join(found) or None


def load_average() -> List[float]:
    """1, 5 and 15-minute load averages of the machine (other processes compete for the cores)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else []


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0


def machine_info(device: torch.device) -> Dict[str, object]:
    info = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "device": str(device), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "malloc": allocator_setting()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info

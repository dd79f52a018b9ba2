"""glibc's allocator for CPU runs: keep freed memory instead of returning it to the system.

glibc returns every block above its mmap threshold (at most 32 MiB) to the OS when it is freed, so
each large temporary is page-faulted in again on its next allocation (at N=16384 a causal LAVO call
took ~400K faults, 40% of its time). A GPU's caching allocator keeps freed blocks; so does glibc with
these two settings, read once at process start (docs/benchmarks.md measures both). The cost: the
process keeps its peak heap. Our CPU entry points (the recipe scripts with DEVICE=cpu, the
quick-start, ``cpu_ddp``) set them unless the environment already does.
"""
from typing import Dict, Mapping

KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 40), "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)}


def keeping_freed_memory(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` with each variable of ``KEEP_FREED_MEMORY`` that it does not set itself."""
    return {**KEEP_FREED_MEMORY, **env}

"""Where one attention module's training step spends its device time: torch.profiler's table of kernels (self
device time, calls) over a few steps of the targets' step (``linattn_tools.benchmark.module_step``: 768 wide, 12
heads, forward + backward), headed by what bounds the step: its wall time, the host's time to issue it and the
device's busy time (the sum of its kernels' times). A device busy for much less than the step's wall time waits on
the host (launch-bound).

    python -m dev.perf.profile_step --method lln --causal --n 4096 --dtype float16 --impl fused
"""
import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from linattn_tools.benchmark.module_step import add_step_arguments, build, module_step_inputs, step


def table(method: str, causal: bool, n: int, tokens: int, dtype: str, impl: str, device: str, steps: int = 3,
          rows: int = 25) -> str:
    """The profiler's table (self time per kernel or op, sorted) of ``steps`` steps after 3 warm-up steps."""
    dev = torch.device(device)
    module = build(method, causal, impl, dtype=getattr(torch, dtype), device=dev)
    x, mask = module_step_inputs(n, dtype=getattr(torch, dtype), device=dev, batch=max(1, tokens // n))
    mask = None if causal else mask
    for _ in range(3):
        step(module, x, mask)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(module, x, mask)
    issued = time.perf_counter()
    sync()
    wall_ms, host_ms = ((t - start) * 1e3 / steps for t in (time.perf_counter(), issued))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(module, x, mask)
        sync()
    averages = prof.key_averages()
    on_device = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    busy_ms = sum(getattr(e, on_device) for e in averages) / 1e3 / steps
    head = f"{method}{' causal' if causal else ''} N={n} B={max(1, tokens // n)} {dtype} impl {impl}, {steps} steps"
    bound = (f"step {wall_ms:.3f} ms wall, {host_ms:.3f} ms to issue on the host, device busy {busy_ms:.3f} ms "
             f"({100 * busy_ms / wall_ms:.0f}% of the step)")
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return head + "\n" + bound + "\n" + averages.table(sort_by=key, row_limit=rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p, impl="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    text = table(args.method, args.causal, args.n, args.tokens_per_step, args.dtype, args.impl, args.device,
                 rows=args.rows)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

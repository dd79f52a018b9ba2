"""Where one attention module's training step spends its device time: torch.profiler's table of kernels (self
device time, calls) over a few steps of the targets' step (``targets.py``: 768 wide, 12 heads, forward + backward).

    python -m linattn_tools.benchmark.profile_step --method lln --causal --n 4096 --dtype float16 --impl fused
"""
import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from linattn_tools.benchmark.gpu_shape import add_step_arguments, build, module_step_inputs, step


def table(method: str, causal: bool, n: int, tokens: int, dtype: str, impl: str, device: str, steps: int = 3,
          rows: int = 25) -> str:
    """The profiler's table (self time per kernel or op, sorted) of ``steps`` steps after 3 warm-up steps."""
    dev = torch.device(device)
    module = build(method, causal, impl, dtype=getattr(torch, dtype), device=dev)
    x, mask = module_step_inputs(n, dtype=getattr(torch, dtype), device=dev, batch=max(1, tokens // n))
    mask = None if causal else mask
    for _ in range(3):
        step(module, x, mask)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(module, x, mask)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    head = f"{method}{' causal' if causal else ''} N={n} B={max(1, tokens // n)} {dtype} impl {impl}, {steps} steps"
    return head + "\n" + prof.key_averages().table(sort_by=key, row_limit=rows)


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

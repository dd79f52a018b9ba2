"""The host's time to issue one attention module's training step, measured on the CPU: the Python, dispatcher and
autograd work a GPU waits on when its kernels finish first. At 32K tokens a step a fused linear step's kernels
take one to two milliseconds (their byte floors, docs/benchmarks.md), about what issuing the step takes, so a
step that costs the host more is bound by the host whatever its kernels do.

Every Triton kernel runs under Triton's interpreter with its launch replaced by nothing (``stub_launches``: the
wrapper around it, its layouts, checks and output allocations, still run), at a tiny step (E = 32, H = 2, N = 8,
one sequence, bf16: ATen's CPU kernels then cost about what a GPU's launches do), the softmax module's beside it.
The fused implementation's GPU launches, and the ATen ops' CUDA launch calls, add to these times on a GPU; the
GPU's own measure is ``linattn_tools.benchmark.targets``' ``issue_s`` and ``profile_step``'s head.

    python -m dev.perf.host_time [--impl fused] [--rounds 5] [--steps 100] [--compile] [--json F]

``--compile``: every module (the softmax one too) with ``--attention-compile`` (its first-step check off), compiled
before the timing: Dynamo's guards and AOTAutograd's wrappers in place of the op's Python (no CUDA graph here).
"""
import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch

from fairseq_linattn.modules.build import build_attention
from linattn.ops.impls import implementation_for
from linattn_tools.benchmark.cli import write_json
from linattn_tools.benchmark.dispatch import count_dispatch
from linattn_tools.benchmark.module_step import step
from linattn_tools.benchmark.targets import BASELINE, TARGETS

EMBED, HEADS, LENGTH = 32, 2, 8
# the moment matcher's one-program kernel whose outputs (the scales, checked > 0 downstream) the stand-in sets to 1
SCALES_KERNEL = "_scales"


@contextlib.contextmanager
def stub_launches() -> Iterator[Dict[str, int]]:
    """Every interpreted Triton kernel's launch replaced by a stand-in that counts it (``{"launches": n}``) and
    runs nothing, but for setting ``SCALES_KERNEL``'s floating arguments to 1. Needs ``TRITON_INTERPRET=1`` before
    Triton is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("host_time: set TRITON_INTERPRET=1 before Triton is imported (the kernels' launches "
                           "are replaced under Triton's interpreter)")
    from triton.runtime.interpreter import InterpretedFunction

    counts = {"launches": 0}

    def launcher(kernel, grid):
        def run(*args, **kwargs):
            counts["launches"] += 1
            if kernel.fn.__name__ == SCALES_KERNEL:
                for arg in args:
                    if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                        arg.fill_(1.0)
        return run

    original = InterpretedFunction.__getitem__
    InterpretedFunction.__getitem__ = launcher
    try:
        yield counts
    finally:
        InterpretedFunction.__getitem__ = original


@contextlib.contextmanager
def stub_replays(on: bool) -> Iterator[None]:
    """``--attention-cuda-graph``'s capture replaced, if ``on``, by the CPU stand-in whose replays run nothing
    (``graph_standin``): a graphed step's host time is then what the graphs leave the host."""
    if not on:
        yield
        return
    from dev.perf import graph_standin
    from fairseq_linattn.modules import cuda_graph

    original = cuda_graph.capture
    cuda_graph.capture = functools.partial(graph_standin.capture, replays=False)
    try:
        yield
    finally:
        cuda_graph.capture = original


class Series:
    """One series' module and step inputs (non-causal steps with the last token padded), stepped with the kernels
    stubbed (``stub_launches``)."""

    def __init__(self, method: str, causal: bool, impl: str, compiled: bool = False, graphed: bool = False):
        self.method, self.causal = method, causal
        config = {"attention_impl": impl}
        if compiled:
            config.update(attention_compile=True, attention_compile_check="off")
        if graphed:
            config.update(attention_cuda_graph=True)
        self.module = build_attention(method, EMBED, HEADS, causal=causal, config=config)
        self.module = self.module.to(dtype=torch.bfloat16).train()
        self.x = torch.randn(LENGTH, 1, EMBED, dtype=torch.bfloat16, requires_grad=True)
        self.mask = None if causal else torch.arange(LENGTH)[None, :] >= LENGTH - LENGTH // 8
        self.impl = implementation_for(method, impl, self.x.new_empty((1, 1, 1, EMBED // HEADS)))
        self.medians: List[float] = []

    def step(self) -> None:
        step(self.module, self.x, self.mask)

    def time(self, steps: int) -> None:
        """The median host time of ``steps`` steps, kept (``row`` reports the least of these medians)."""
        times = []
        for _ in range(steps):
            start = time.thread_time()
            self.step()
            times.append(time.thread_time() - start)
        self.medians.append(statistics.median(times))

    def row(self, launches: int) -> dict:
        """The series' host time (the least median: the one least disturbed by other work on the machine), its
        dispatched ops (ATen's and the custom ops: at least a GPU launch each) and ``launches`` Triton launches a
        step."""
        with count_dispatch() as ops:
            self.step()
        return {"method": self.method, "causal": self.causal, "impl": self.impl, "host_s": min(self.medians),
                "medians_s": self.medians, "ops": ops.launched, "triton_launches": launches}


def measure(impl: str, rounds: int, steps: int, compiled: bool = False, graphed: bool = False) -> List[dict]:
    """Every series of ``series()`` (the linear ones in ``impl``; each module compiled if ``compiled``; the linear
    ones' steps captured if ``graphed``, replays standing in for nothing), timed in ``rounds`` interleaved rounds of
    ``steps`` steps each after 20 untimed ones."""
    runs = [Series(m, c, "auto" if m == BASELINE else impl, compiled, graphed and m != BASELINE) for m, c in series()]
    with stub_launches() as counts, stub_replays(graphed):
        launches = []
        for run in runs:
            for _ in range(20):
                run.step()
            counts["launches"] = 0
            run.step()
            launches.append(counts["launches"])
        for _ in range(rounds):
            for run in runs:
                run.time(steps)
        return [run.row(n) for run, n in zip(runs, launches)]


def series() -> List[tuple]:
    """The targets' series and the softmax module of each causality."""
    return [(m, c) for c in (False, True) for m in [BASELINE] + [m for m, cc in TARGETS if cc == c]]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="fused", help="the linear methods' --attention-impl (default fused)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the series (the least median kept)")
    p.add_argument("--steps", type=int, default=100, help="steps timed per series and round (their median)")
    p.add_argument("--compile", action="store_true", help="every module with --attention-compile")
    p.add_argument("--cuda-graph", action="store_true",
                   help="the linear modules with --attention-cuda-graph, each replay standing in for nothing")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    rows = measure(args.impl, args.rounds, args.steps, args.compile, args.cuda_graph)
    base = {r["causal"]: r["host_s"] for r in rows if r["method"] == BASELINE}
    print(f"host time of one training step (E = {EMBED}, H = {HEADS}, N = {LENGTH}, bf16, kernels not run"
          f"{', compiled' if args.compile else ''}{', linear steps graphed' if args.cuda_graph else ''}), "
          f"torch {torch.__version__}")
    print("| series | implementation | host ms | over softmax's | ops dispatched | Triton launches |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + (" causal" if r["causal"] else "")
        print(f"| {name} | `{r['impl']}` | {r['host_s'] * 1e3:.2f} | {r['host_s'] / base[r['causal']]:.2f}× | "
              f"{r['ops']} | {r['triton_launches']} |")
    if args.json:
        write_json(Path(args.json), {"torch": torch.__version__, "embed": EMBED, "heads": HEADS, "length": LENGTH,
                               "impl": args.impl, "compiled": args.compile,
                               "cuda_graph": args.cuda_graph, "rounds": args.rounds,
                               "steps": args.steps,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``speed`` stage: the targets of the fused implementation (docs/design.md §1.3.1;
``python -m linattn_tools.benchmark.targets``): one attention module's training step at 32K tokens a step with
``--attention-impl fused``, in float16 and bfloat16 (where the GPU has it), at N = 4096 and 16384, against the softmax
module of the same causality in the same dtype (SDPA on its flash kernel), each point in a process of its own; on
the CPU, in float32, the implementations ``auto`` picks (``fused`` refuses float32).

Verdict (CUDA only): each series' time over the softmax module's within its target at that N, and its peak memory
within ``MEMORY_LIMIT`` times the softmax module's; each row names the implementation that ran. On the CPU (float32,
tiny sizes, where no target is set) the rows are reported without a verdict.
"""
import json
import sys
from typing import Optional

from .core import Settings, Stage, run_logged

SIZES = (4096, 16384)
QUICK_SIZES = (64,)  # --quick: one point, a check that the stage runs


def run_point(settings: Settings, dtype: str, n: int) -> Optional[dict]:
    """The targets benchmark's JSON at one (dtype, N), or None (its log says why)."""
    out = settings.stage_dir("speed")
    result = out / f"targets_{dtype}_{n}.json"
    impl = "fused" if settings.cuda else "auto"  # the kernels take half inputs on CUDA and refuse the CPU's float32
    cmd = [sys.executable, "-m", "linattn_tools.benchmark.targets", "--n", str(n), "--dtype", dtype, "--impl", impl,
           "--device", settings.device, "--json", result]
    if settings.quick:
        cmd += ["--tokens-per-step", str(2 * n), "--warmup", "1", "--repeats", "1"]
    code = run_logged(cmd, out / f"targets_{dtype}_{n}.log")
    return json.loads(result.read_text()) if code == 0 and result.is_file() else None


def speed_stage(settings: Settings) -> Stage:
    from linattn_tools.benchmark.targets import BASELINE, MEMORY_LIMIT, TARGETS
    from linattn_tools.benchmark.targets import SIZES as GOAL_SIZES

    dtypes = ("float16", "bfloat16") if settings.bf16 else ("float16",)
    stage = Stage("speed", note="the fused implementation's targets at 32K tokens a step (docs/design.md §1.3.1)"
                  if settings.cuda else "CPU, float32, tiny sizes: reported without a verdict (the targets are for "
                  "a GPU)")
    for dtype in dtypes if settings.cuda else ("float32",):
        for n in QUICK_SIZES if settings.quick else SIZES:
            res = run_point(settings, dtype, n)
            if res is None:
                stage.judge(f"targets {dtype} N={n}", False, "no result", "exit 0",
                            str(settings.work / "speed" / f"targets_{dtype}_{n}.log"))
                continue
            rows = {(r["method"], r["causal"]): r for r in res["rows"]}
            for (method, causal), goals in TARGETS.items():
                series = f"{method}{' causal' if causal else ''} {dtype} N={n}"
                mine, base = rows.get((method, causal)), rows.get((BASELINE, causal))
                goal = dict(zip(GOAL_SIZES, goals)).get(n) if settings.cuda else None
                threshold = (f"<= x{goal:g} time, <= x{MEMORY_LIMIT:g} peak of the {BASELINE} module"
                             if goal is not None else "—")
                if mine is None or base is None:
                    stage.add(series, "FAIL" if goal is not None else "INFO", "did not run", threshold)
                    continue
                ratio = mine["median_s"] / base["median_s"]
                peak = mine["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else 0.0
                measured = (f"{1e3 * mine['median_s']:.3g} ms vs {1e3 * base['median_s']:.3g} ms (x{ratio:.2f}), "
                            f"peak x{peak:.2f}")
                status = "INFO" if goal is None else "PASS" if ratio <= goal and peak <= MEMORY_LIMIT else "FAIL"
                stage.add(series, status, measured, threshold, f"implementation {mine['impl']}")
    return stage

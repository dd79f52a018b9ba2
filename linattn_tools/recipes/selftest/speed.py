"""The ``speed`` stage: ``python -m linattn_tools.benchmark.attention`` once per implementation (``--impl parallel``
and ``--impl looped``), forward + backward timed between CUDA events at N = 4K, 8K and 16K.

Verdict (CUDA only): at the largest N, every linear method (the registry's methods that are not quadratic) in the
impl ``auto`` picks on the device is at most as slow as SDPA with the same causality. Each row shows both
implementations' ATen op and host sync counts. On the CPU (tiny sizes) the rows are reported without a verdict.
"""
import json
import sys
from typing import Dict, Optional

from .core import Settings, Stage, run_logged
from .ops import IMPLS

SIZES = (4096, 8192, 16384)


def run_benchmark(settings: Settings, impl: str) -> Optional[dict]:
    """The benchmark's JSON for one implementation, or None (its log says why)."""
    out = settings.stage_dir("speed")
    result = out / f"attention_{impl}.json"
    cmd = [sys.executable, "-m", "linattn_tools.benchmark.attention", "--impl", impl, "--device", settings.device,
           "--malloc", "default", "--json", result, "--plot", out / f"attention_{impl}.png"]
    cmd += ["--quick"] if settings.quick else ["--sizes", *map(str, SIZES), "--repeats", "5", "--min-repeats", "3"]
    code = run_logged(cmd, out / f"attention_{impl}.log")
    return json.loads(result.read_text()) if code == 0 and result.is_file() else None


def point(res: dict, series: str, n: int) -> Optional[dict]:
    return next((p for p in res["points"].get(series, []) if p["n"] == n and p["status"] == "ok"), None)


def counts(results: Dict[str, dict], series: str, n: int) -> str:
    """'parallel 69 ops, 0 syncs; looped 69 ops, 0 syncs'."""
    parts = []
    for impl, res in results.items():
        p = point(res, series, n)
        parts.append(f"{impl} " + ("—" if p is None or "aten_ops" not in p else
                                   f"{p['aten_ops']} ops, {p['host_syncs']} syncs, {1e3 * p['median_s']:.3g} ms"))
    return "; ".join(parts)


def speed_stage(settings: Settings) -> Stage:
    import torch

    from linattn.methods import METHODS
    from linattn.ops.impls import resolve_impl
    from linattn_tools.methods_extra import METHODS_EXTRA

    judged = resolve_impl("auto", torch.device(settings.device))
    stage = Stage("speed", note=f"verdict on the {judged} impl (auto on {settings.device})" if settings.cuda else
                  "CPU at tiny sizes: reported without a verdict (the thresholds are for a GPU at 16K)")
    results = {}
    for impl in IMPLS:
        res = run_benchmark(settings, impl)
        if res is None:
            stage.judge(f"benchmark --impl {impl}", False, "no result", "exit 0",
                        str(settings.work / "speed" / f"attention_{impl}.log"))
        else:
            results[impl] = res
    if judged not in results:
        return stage
    res = results[judged]
    n = max(p["n"] for pts in res["points"].values() for p in pts)
    for name, method in METHODS.items():
        if METHODS_EXTRA[name].quadratic:
            continue
        for causal in (False, True) if method.causal else (False,):
            series, sdpa = (f"{name} causal", "softmax causal") if causal else (name, "softmax")
            mine, base = point(res, series, n), point(res, sdpa, n)
            detail = counts(results, series, n)
            if mine is None:
                stage.add(f"{series} at N={n}", "FAIL" if settings.cuda else "INFO", "did not run",
                          f"<= {sdpa}", detail)
                continue
            ratio = mine["median_s"] / base["median_s"] if base else None
            measured = (f"{1e3 * mine['median_s']:.3g} ms vs {1e3 * base['median_s']:.3g} ms (x{ratio:.2f})"
                        if base else f"{1e3 * mine['median_s']:.3g} ms; {sdpa} did not run")
            status = "INFO" if not settings.cuda else "PASS" if ratio is None or ratio <= 1.0 else "FAIL"
            stage.add(f"{series} at N={n}", status, measured, f"<= {sdpa} (SDPA)", detail)
    return stage

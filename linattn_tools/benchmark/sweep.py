"""Run cases over growing sizes; stop a case at the first size over a time or memory budget.

Each size is measured for all still-running cases before the next size, so cases compared at one
size see the same machine load. With ``interleave`` the repeats go round-robin over the cases
(their callables stay alive together); otherwise one case is built, measured and freed at a time.
A case is not run at a size where its last two points predict (power-law extrapolation) more
than the budget: the row says so, and the case stops.
"""
import gc
import math
import statistics
from typing import Callable, Dict, List, Optional

import torch

from . import measure

Case = Callable[[int, object], Callable[[], object]]  # (size, shared per-size setup) -> the call to time


def _predict(points: List[dict], n: int, key: str) -> Optional[float]:
    """Extrapolate ``key`` to size n from the last two measured points (exponent clamped to [1, 3])."""
    ok = [p for p in points if p["status"] == "ok" and p.get(key)]
    if not ok:
        return None
    last = ok[-1]
    exponent = 1.0
    if len(ok) >= 2 and ok[-2][key] > 0 and last["n"] != ok[-2]["n"]:
        exponent = math.log(last[key] / ok[-2][key]) / math.log(last["n"] / ok[-2]["n"])
        exponent = min(max(exponent, 1.0), 3.0)
    return last[key] * (n / last["n"]) ** exponent


def _over_budget(time_s: Optional[float], peak: Optional[float], time_budget: float,
                 memory_budget: float) -> Optional[str]:
    if time_s is not None and time_s > time_budget:
        return f"{time_s:.1f} s > {time_budget:g} s budget"
    if peak is not None and peak > memory_budget:
        return f"{peak / 2**30:.2f} GiB > {memory_budget / 2**30:g} GiB budget"
    return None


def run(cases: Dict[str, Case], sizes: List[int], device: torch.device, *,
        setup: Callable[[int], object] = lambda n: None,
        time_budget: float, memory_budget: float, warmup: int = 1, repeats: int = 5, min_repeats: int = 3,
        point_seconds: float = 60.0, measure_memory: bool = True, interleave: bool = True,
        log: Callable[[str], None] = print) -> Dict[str, object]:
    """Measure every case at every size; returns {"points": {case: [row...]}, "matmul_flops": {n: rate}}.

    A row: {"n", "status" ("ok", "over budget", "skipped", "error"), "median_s", "min_s",
    "samples_s", "peak_bytes", "load", "note"} and whatever ``call.extra()`` returns, if the call
    has that attribute. ``time_budget`` is per call (seconds), ``memory_budget`` in bytes.
    """
    points: Dict[str, List[dict]] = {name: [] for name in cases}
    stopped: Dict[str, str] = {}
    matmul: Dict[int, float] = {}
    for n in sizes:
        shared = setup(n)
        live, planned = {}, {}
        for name, case in cases.items():
            row = {"n": n, "status": "skipped", "note": stopped.get(name)}
            points[name].append(row)
            if name in stopped:
                continue
            guess = _over_budget(_predict(points[name], n, "median_s"), _predict(points[name], n, "peak_bytes"),
                                 time_budget, memory_budget)
            if guess:
                stopped[name] = row["note"] = "predicted " + guess
                log(f"{name} N={n}: skipped, {row['note']}")
                continue
            try:
                call = case(n, shared)
                warm = [measure.elapsed_seconds(call, device) for _ in range(max(warmup, 1))]
                peak = measure.peak_memory_bytes(call, device) if measure_memory else None
            except (RuntimeError, MemoryError) as err:  # e.g. out of memory on the device
                row.update(status="error", note=str(err).splitlines()[0][:200])
                stopped[name] = f"error at N={n}"
                log(f"{name} N={n}: error {row['note']}")
                continue
            row.update(warmup_s=warm, peak_bytes=peak, **(call.extra() if hasattr(call, "extra") else {}))
            over = _over_budget(warm[-1], peak, time_budget, memory_budget)
            if over:
                row.update(status="over budget", median_s=warm[-1], min_s=min(warm), samples_s=warm, note=over)
                stopped[name] = f"over budget at N={n}"
                log(f"{name} N={n}: over budget, {over}")
                continue
            planned[name] = max(min_repeats, min(repeats, int(point_seconds // max(warm[-1], 1e-9))))
            if interleave:
                live[name] = call
            else:
                _finish(row, [measure.elapsed_seconds(call, device) for _ in range(planned[name])], log, name)
                del call
                gc.collect()
        rates = []
        for r in range(max(max(planned.values(), default=1), 1) if interleave else 1):  # a matmul rate per round
            rates.append(measure.matmul_flops_per_second(device, repeats=1))
            for name, call in live.items():
                if r < planned[name]:
                    points[name][-1].setdefault("samples_s", []).append(measure.elapsed_seconds(call, device))
        for name in live:
            _finish(points[name][-1], points[name][-1]["samples_s"], log, name)
        matmul[n] = sorted(rates)[len(rates) // 2]
        del live, shared
        gc.collect()
    return {"points": points, "matmul_flops": matmul}


def _finish(row: dict, samples: List[float], log, name: str) -> None:
    row.update(status="ok", samples_s=samples, median_s=statistics.median(samples), min_s=min(samples),
               load=measure.load_average())
    mem = f", peak {row['peak_bytes'] / 2**20:.1f} MiB" if row.get("peak_bytes") is not None else ""
    log(f"{name} N={row['n']}: median {row['median_s']:.4f} s (min {row['min_s']:.4f}, {len(samples)} runs){mem}")

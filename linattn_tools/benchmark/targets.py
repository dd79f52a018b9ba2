"""The fused kernels' targets: one attention module's training step against the softmax module of the same
causality, same dtype, at a fixed number of tokens per step (docs/design.md §1.3, "the fused implementation").

    python -m linattn_tools.benchmark.targets --dtype bfloat16 --n 4096 --json runs/gpu_bench/bfloat16_4096.json
    python -m linattn_tools.benchmark.targets --render runs/gpu_bench/*.json     # the targets table
    python -m linattn_tools.benchmark.targets --render docs/benchmarks/gpu_targets_h100.json --run parallel
    python -m linattn_tools.benchmark.targets --render runs/gpu_bench/*.json --floors docs/benchmarks/step_floors.json
    bash scripts/gpu_bench.sh                                                    # every point, then the table

One step (``module_step``): ``build_attention(method, 768, 12, causal=...)`` with ``attention_impl`` ``--impl``,
weights and inputs in ``--dtype``, B = ``--tokens-per-step`` // N, forward + backward from an output gradient (no
loss); causal steps unpadded, non-causal ones with the last eighth of the last sequence padded. Time: median of
``--repeats`` steps (CUDA events on a GPU) after warm-up; peak memory above the inputs; the host's time to issue a
step; on a GPU the same step captured whole in a CUDA graph and replayed (``graph_replay``: the step's time with the
host out of the way, or why it cannot be captured). Each point records the implementation the module's op ran. At
each N also a baseline, causal: flash-linear-attention's chunked linear attention in the softmax module's projections
(``fla_baseline``), where fla-core runs (a GPU), else the reason.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from linattn.ops.impls import IMPLS, implementation_for
from linattn_tools.benchmark import fla_baseline, flops, graph_replay, measure
from linattn_tools.benchmark.module_step import build, module_step_inputs, step

from .cli import write_json

SIZES = (2048, 4096, 16384, 32768)
# the time over the softmax module's at each of SIZES (issue table: LLN+Diag in both causalities), and the peak
# memory limit at every N
TARGETS = {("lln", False): (1.0, 0.6, 0.2, 0.12), ("lln", True): (1.0, 0.6, 0.2, 0.12),
           ("lln_diag", False): (1.3, 0.8, 0.3, 0.15), ("lln_diag", True): (1.3, 0.8, 0.3, 0.15),
           ("lavo", True): (1.3, 0.8, 0.3, 0.15), ("skyformer", False): (1.5, 1.0, 0.3, 0.15)}
MEMORY_LIMIT = 1.5
BASELINE = "softmax"  # the module every series is compared with (same causality)
FLOP_OPTS = {"chunk_size": 64, "block_size": 64, "window": 64, "bases": 64, "landmarks": 128}


def time_step(method: str, causal: bool, n: int, args) -> Tuple[dict, Callable[[], None]]:
    """One series at one N: (its row: median step time, host issue time, peak memory, the implementation its op ran
    (the baseline ``fla_baseline.METHOD``: fla-core and its version); its step, for ``replay``)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    batch = max(1, args.tokens_per_step // n)
    if method == fla_baseline.METHOD:
        module = fla_baseline.build_baseline(dtype=dtype, device=device)
        impl = f"{fla_baseline.IMPL} {fla_baseline.fla_version()}"
    else:
        module = build(method, causal, args.impl, dtype=dtype, device=device)
        impl = implementation_for(method, args.impl, torch.empty((1, 1, 1, module.head_dim), dtype=dtype,
                                                                 device=device))
    x, mask = module_step_inputs(n, dtype=dtype, device=device, batch=batch)
    mask = None if causal else mask
    run = lambda: step(module, x, mask)  # noqa: E731
    for _ in range(args.warmup):
        run()
    times = [measure.elapsed_seconds(run, device) for _ in range(args.repeats)]
    row = {"method": method, "causal": causal, "n": n, "batch": batch, "dtype": args.dtype, "impl": impl,
           "median_s": statistics.median(times),
           "issue_s": statistics.median(issue_seconds(run, device) for _ in range(args.repeats)),
           "peak_bytes": measure.peak_memory_bytes(run, device)}
    return row, run


def replay(row: dict, run: Callable[[], None], args) -> None:
    """Into ``row``: its step's CUDA graph replay time (``replay_s``; None and ``replay_why`` where there is none).
    After every eager measure of a point: a capture that fails cannot spoil them."""
    row["replay_s"], row["replay_why"] = graph_replay.replay_seconds(run, torch.device(args.device), args.repeats)


def issue_seconds(run, device: torch.device) -> float:
    """The host's time to issue one ``run()`` from an idle device (on a GPU: its launches queued, not waited
    for); a step whose time is close to it is bound by the host, not by its kernels."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    sync()
    return seconds


def measure_point(args) -> dict:
    """Every series of ``TARGETS`` and the softmax module of each causality at one N, and the baseline
    ``fla_baseline.METHOD`` (causal) where fla-core runs (``left_out``: else why not)."""
    why = fla_baseline.unavailable(args.device)
    rows, runs = [], []
    for causal in (False, True):
        baselines = [fla_baseline.METHOD] if causal and why is None else []
        for method in [BASELINE] + [m for m, c in TARGETS if c == causal] + baselines:
            row, run = time_step(method, causal, args.n, args)
            rows.append(row)
            runs.append(run)
            note = ""
            if method == BASELINE:
                work = flops.training_flops(method, row["n"], row["batch"], 12, 64, causal=causal, opts=FLOP_OPTS)
                note = f", SDPA {work / row['median_s'] / 1e12:.3f} TFLOP/s"
            print(f"{args.dtype} N={args.n} B={row['batch']} {method}{' causal' if causal else ''}: "
                  f"{row['median_s'] * 1e3:.2f} ms (issued in {row['issue_s'] * 1e3:.2f}), "
                  f"peak {row['peak_bytes'] / 2**20:.1f} MiB, "
                  f"implementation {row['impl']}{note}", flush=True)
    if why is not None:
        print(f"{fla_baseline.METHOD} causal left out: {why}", flush=True)
    for row, run in zip(rows, runs):
        replay(row, run, args)
        if torch.device(args.device).type == "cuda":
            print(f"{args.dtype} N={args.n} {row['method']}{' causal' if row['causal'] else ''}: {_replay(row)}",
                  flush=True)
    if rows and torch.device(args.device).type != "cuda":
        print(_replay(rows[0]), flush=True)
    return {"machine": measure.machine_info(torch.device(args.device)), "rows": rows,
            "left_out": {} if why is None else {fla_baseline.METHOD: why}}


def _replay(row: dict) -> str:
    """A point's CUDA graph replay for its printed line."""
    return f"replayed in {row['replay_s'] * 1e3:.2f} ms" if row.get("replay_s") else f"no replay: {row['replay_why']}"


def render(results: List[dict], floors: Optional[dict] = None) -> str:
    """Markdown: per dtype and series, time / the softmax module's (target in brackets, the implementation that
    ran; with ``floors``, docs/benchmarks/step_floors.json as the developer tool ``python -m dev.perf.traffic --floors``
    writes it, the step's floor over its time for ``fused`` points) and the worst peak memory ratio, for every N
    measured."""
    rows = [r for res in results for r in res["rows"]]
    floor_of = (floors or {}).get("floors", {})
    lines = []
    for dtype in sorted({r["dtype"] for r in rows}):
        sizes = sorted({r["n"] for r in rows if r["dtype"] == dtype})
        lines += [f"**{dtype}**", "", "| series | " + " | ".join(f"N={n}" for n in sizes) + " | peak / softmax |",
                  "|---|" + "---|" * (len(sizes) + 1)]
        for (method, causal), goals in TARGETS.items():
            cells, peaks = [], []
            for n in sizes:
                mine = _find(rows, dtype, n, method, causal)
                base = _find(rows, dtype, n, BASELINE, causal)
                if not (mine and base):
                    cells.append("–")
                    continue
                ratio = mine["median_s"] / base["median_s"]
                goal = dict(zip(SIZES, goals)).get(n)
                met = "" if goal is None else (" ✓" if ratio <= goal else " ✗") + f" (≤{goal:g})"
                floor = floor_of.get(f"{method}{' causal' if causal else ''}", {}).get(str(n))
                at_floor = f", floor {floor / mine['median_s']:.0%}" if floor and mine["impl"] == "fused" else ""
                cells.append(f"{ratio:.2f}×{met} `{mine['impl']}`{at_floor}")
                if base["peak_bytes"]:
                    peaks.append(mine["peak_bytes"] / base["peak_bytes"])
            worst = f"{max(peaks):.2f}× ({'✓' if max(peaks) <= MEMORY_LIMIT else '✗'} ≤{MEMORY_LIMIT:g})" if peaks \
                else "–"
            lines.append(f"| {method}{' causal' if causal else ''} | " + " | ".join(cells) + f" | {worst} |")
        lines += _baseline_lines(rows, dtype, sizes)
        lines.append("")
        lines += _replay_lines(rows, dtype, sizes)
    machines = sorted({f"{res['machine'].get('gpu', res['machine']['cpu'])}, torch {res['machine']['torch']}"
                       for res in results})
    return "\n".join(lines + ["Measured on: " + "; ".join(machines)])


def _baseline_lines(rows: List[dict], dtype: str, sizes: List[int]) -> List[str]:
    """The table's row of ``fla_baseline.METHOD`` (causal, no target) where a point measured it."""
    mine = [_find(rows, dtype, n, fla_baseline.METHOD, True) for n in sizes]
    if not any(mine):
        return []
    cells = [f"{m['median_s'] / base['median_s']:.2f}× `{m['impl']}`" if m and base else "–"
             for m, base in zip(mine, (_find(rows, dtype, n, BASELINE, True) for n in sizes))]
    return [f"| {fla_baseline.METHOD} causal (baseline) | " + " | ".join(cells) + " | – |"]


def _replay_lines(rows: List[dict], dtype: str, sizes: List[int]) -> List[str]:
    """Where points were replayed from a CUDA graph (``graph_replay``): each series' eager step time over its
    replay's (what capturing the step would gain) and its host issue time over its eager time (near 1: the host binds
    the step), or why the step could not be captured."""
    series = [(BASELINE, False), (BASELINE, True), *TARGETS]
    found = {(m, c): [_find(rows, dtype, n, m, c) for n in sizes] for m, c in series}
    if not any(r and r.get("replay_s") for cells in found.values() for r in cells):
        return []
    lines = [f"CUDA graph replay ({dtype}): eager step / its replay (issue time / eager step)", "",
             "| series | " + " | ".join(f"N={n}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for (method, causal), cells in found.items():
        text = ["–" if r is None else f"{r['median_s'] / r['replay_s']:.2f}× ({r['issue_s'] / r['median_s']:.2f})"
                if r.get("replay_s") else f"not captured: {r.get('replay_why')}" for r in cells]
        lines.append(f"| {method}{' causal' if causal else ''} | " + " | ".join(text) + " |")
    return lines + [""]


def _find(rows, dtype, n, method, causal) -> Optional[dict]:
    return next((r for r in rows if (r["dtype"], r["n"], r["method"], r["causal"]) == (dtype, n, method, causal)),
                None)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="sequence length of this point")
    p.add_argument("--tokens-per-step", type=int, default=32768, help="B = this // N (at least 1)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--impl", choices=IMPLS, default="fused", help="the linear modules' attention_impl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="write this point's results here")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                   help="measure nothing: print the targets table of these points")
    p.add_argument("--run", default=None, help="with --render, of a file holding several runs "
                   "(docs/benchmarks/gpu_targets_h100.json): the one of this name")
    p.add_argument("--floors", type=Path, default=None, metavar="JSON",
                   help="with --render: each fused step's floor over its time, from this file "
                        "(docs/benchmarks/step_floors.json, counted on the meta device by a developer tool: "
                        "python -m dev.perf.traffic --floors FILE)")
    args = p.parse_args(argv)
    if args.render:
        results = [json.loads(path.read_text()) for path in args.render]
        if args.run:
            results = [{"machine": res["machine"], "rows": res["runs"][args.run]["rows"]} for res in results]
        print(render(results, json.loads(args.floors.read_text()) if args.floors else None))
        return 0
    res = measure_point(args)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

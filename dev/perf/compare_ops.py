#!/usr/bin/env python
"""The attention ops of an earlier commit against this tree's: time and peak memory, forward + backward.

Both sets of ops run in one process with calls alternating (first one side, then the other, swapped every
repeat), so the shared machine's drift falls on both alike; the ratio after / before is the result. What ran
before in a process moves that ratio (non-causal LLN at N = 4096 read 1.01-1.06 in fresh processes and
1.24-1.28 in processes that had run causal LLN first): with ``--processes P`` every (N, op)
is compared in P fresh processes of its own, and a row is the median over them, with their range. The
earlier ops come from ``git archive <commit> linattn/ops`` (no fairseq import, see docs/design.md §1).
Prints a table, writes JSON, and with --docs rewrites a section of docs/benchmarks.md. With ``--malloc keep``
(the default) the tool restarts with glibc keeping freed memory, as ``linattn_tools.benchmark.attention`` does.

    python -m dev.perf.compare_ops --baseline 99cd0d5 --sizes 16384 32768 \
        --json docs/benchmarks/ops_vs_99cd0d5.json --docs docs/benchmarks.md --section "ops against 99cd0d5"
"""
import argparse
import importlib.util
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from linattn import ops
from linattn_tools.benchmark import cli, measure, report
from linattn_tools.benchmark.cli import write_json
from linattn_tools.methods_extra import METHODS_EXTRA

CASES = ["lln", "lln causal", "lln_diag", "lln_diag causal", "lavo", "lavo causal", "skyformer"]
TOLERANCE = 0.05  # the time target of the allocation-light ops: no op slower than before with --malloc keep (±5 %)


def load_ops(commit: str, into: Path):
    """The ops package of ``commit`` (``linattn/ops``, or ``fairseq_linattn/ops`` before the two were split),
    imported as ``ops_<commit>`` from a copy in ``into``."""
    for path in ("linattn/ops", "fairseq_linattn/ops"):
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-d", commit, path], check=True,
                                capture_output=True, text=True).stdout
        if listed.strip():
            break
    else:
        raise SystemExit(f"error: commit {commit} has no ops package")
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, path], check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(into, filter="data")
    name = f"ops_{commit}"
    package = (into / path).rename(into / name)
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def inputs(n: int, b: int = 1, h: int = 12, d: int = 64):
    """q, k, v, output gradient (B,H,N,D), LLN's alpha and beta, LAVO's bases (r = 64) and bias (w = 64)."""
    g = torch.Generator().manual_seed(n)
    q, k, v, grad = (torch.randn(b, h, n, d, generator=g) for _ in range(4))
    alpha, beta = (float(x) for x in ops.lln_alpha_beta(torch.tensor(1.0), torch.tensor(1.0)))
    lavo = [ops.lavo_init_bases(h, 64, d).requires_grad_(), torch.zeros(h, 127, requires_grad=True)]
    return [t.requires_grad_() for t in (q, k, v)], grad, alpha, beta, lavo


def call(mod, case: str, x) -> None:
    """One forward + gradient w.r.t. every input of ``case`` with the ops module ``mod`` (its
    ``benchmark_op``; chunk and blocks 64, LAVO w = 64, Skyformer 128 landmarks)."""
    (q, k, v), grad, alpha, beta, (bases, bias) = x
    name, causal = case.split(" ")[0], case.endswith("causal")
    op = METHODS_EXTRA[name]
    settings = {"alpha": alpha, "beta": beta, "chunk_size": 64, "block_size": 64, "window": 64, "landmarks": 128,
                "lavo_bases": bases, "lavo_bias": bias}
    out = op.benchmark_op(mod, q, k, v, causal, settings)
    torch.autograd.grad(out, [q, k, v] + [settings[p] for p in op.benchmark_params], grad)


def compare(before, after, sizes, cases, repeats: int) -> list:
    """Per (N, case): median ms of each side over ``repeats`` alternating calls, after / before, peak MiB."""
    rows, cpu = [], torch.device("cpu")
    for n in sizes:
        x = inputs(n)
        for case in cases:
            sides = {"before": before, "after": after}
            times = {side: [] for side in sides}
            for mod in sides.values():
                call(mod, case, x)  # warm-up
            for r in range(repeats):
                for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    t0 = time.perf_counter()
                    call(sides[side], case, x)
                    times[side].append(time.perf_counter() - t0)
            row = {"n": n, "op": case, "samples_s": times,
                   **{f"{s}_ms": statistics.median(t) * 1e3 for s, t in times.items()},
                   **{f"{s}_peak_mib": measure.peak_memory_bytes(lambda: call(m, case, x), cpu) / 2 ** 20
                      for s, m in sides.items()},
                   "load": measure.load_average()}
            row["ratio"] = row["after_ms"] / row["before_ms"]
            rows.append(row)
            print(f"N={n:6d} {case:16s} {row['before_ms']:8.1f} -> {row['after_ms']:8.1f} ms ({row['ratio']:.2f}x)"
                  f"  peak {row['before_peak_mib']:.0f} -> {row['after_peak_mib']:.0f} MiB", flush=True)
    return rows


def compare_in_processes(argv: list, sizes, cases, processes: int) -> list:
    """Each (N, case) compared in ``processes`` fresh processes of this script (rounds over every point, so
    the machine's drift spreads over all); per point the median of their medians and ratios, and the range."""
    runs = {}
    for p in range(processes):
        for n in sizes:
            for case in cases:
                print(f"[process {p + 1}/{processes}] N={n} {case}", flush=True)
                child = cli.run_child([*argv, "--sizes", str(n), "--cases", case, "--processes", "1"], plot=False)
                runs.setdefault((n, case), []).extend(child["rows"])
    return [merge_processes(rows) for rows in runs.values()]


def merge_processes(rows: list) -> dict:
    """One point measured by several processes: median times and ratio, the ratios' range, every sample."""
    ratios = [r["ratio"] for r in rows]
    return {"n": rows[0]["n"], "op": rows[0]["op"], "processes": len(rows),
            **{k: statistics.median(r[k] for r in rows) for k in ("before_ms", "after_ms", "ratio")},
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "before_peak_mib": rows[0]["before_peak_mib"], "after_peak_mib": rows[0]["after_peak_mib"],
            "samples_s": [r["samples_s"] for r in rows], "load": [r["load"] for r in rows]}


def render(res: dict) -> str:
    base = res["baseline"]
    procs = res.get("processes", 1)
    how = ("the two sides alternating in one process" if procs == 1 else
           f"the two sides alternating, in each of {procs} fresh processes per point; the times and the ratio are "
           f"the medians over the processes, the range is their ratios'")
    lines = [report.machine_lines(res["machine"], res["load_start"]), "",
             f"B=1, H=12, D=64, float32; one call = forward + gradient w.r.t. every input; median of "
             f"{res['repeats']} calls per side, {how}. Options: causal LLN "
             f"chunk 64, blocks 64, LAVO w=64 r=64, Skyformer 128 landmarks.", "",
             f"| N | op | time at {base} (ms) | time now (ms) | now / {base} |" + (" range |" if procs > 1 else "")
             + f" peak at {base} (MiB) | peak now (MiB) |",
             "|---|---|---|---|---|---|---|" + ("---|" if procs > 1 else "")]
    for r in res["rows"]:
        spread = f" {r['ratio_min']:.2f}–{r['ratio_max']:.2f} |" if procs > 1 else ""
        lines.append(f"| {r['n']} | {r['op']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['ratio']:.2f} |"
                     f"{spread} {r['before_peak_mib']:.0f} | {r['after_peak_mib']:.0f} |")
    worst = max(res["rows"], key=lambda r: r["ratio"])
    met = worst["ratio"] <= 1 + TOLERANCE
    lines += ["", report.targets_table([{
        "target": f"no op slower than at {base} with freed memory kept (±{TOLERANCE:.0%}), worst of every op and N",
        "measured": f"{worst['ratio']:.2f}× ({worst['op']}, N={worst['n']})", "met": met}])]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="99cd0d5", help="git commit whose ops are the 'before' (default 99cd0d5, "
                   "the ops before the allocation-light rewrite)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--cases", nargs="+", default=CASES, choices=CASES, metavar="CASE",
                   help=f"ops to compare (default all: {', '.join(CASES)})")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per side and point (default 7)")
    p.add_argument("--processes", type=int, default=1,
                   help="compare each (N, op) in this many fresh processes and report the median (default 1: "
                        "every point in this process)")
    p.add_argument("--malloc", choices=["keep", "default"], default="keep",
                   help="keep: restart with glibc keeping freed memory (the setting of the time target); "
                        "default: glibc's own")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--docs", type=Path, default=None, help="rewrite --section of this markdown")
    p.add_argument("--section", default="ops against the baseline")
    args = p.parse_args(argv)
    if args.malloc == "keep" and argv is None:
        measure.restart_keeping_freed_memory(sys.argv)
    torch.manual_seed(0)
    res = {"baseline": args.baseline, "repeats": args.repeats, "processes": args.processes,
           "machine": measure.machine_info(torch.device("cpu")), "load_start": measure.load_average()}
    if args.processes > 1:
        child = ["--baseline", args.baseline, "--repeats", str(args.repeats), "--malloc", args.malloc]
        res["rows"] = compare_in_processes(child, args.sizes, args.cases, args.processes)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            before = load_ops(args.baseline, Path(tmp))
            res["rows"] = compare(before, ops, args.sizes, args.cases, args.repeats)
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    text = render(res)
    print(text)
    if args.docs:
        report.write_section(args.docs, args.section, text)
        print(f"updated {args.docs}")


if __name__ == "__main__":
    main()

"""Forward+backward time and peak memory of every attention op against sequence length.

Compares each op of ``linattn.ops`` with PyTorch's ``scaled_dot_product_attention`` (the
``softmax`` op), causal and non-causal where defined, at N = 512 ... 32768 (LLN Table 2, LAVO
Table 2, Skyformer Table 2). Writes a JSON, a markdown table (also into docs/benchmarks.md with
``--docs``), a log-log PNG, the fitted scaling exponents and, for every method, the ratio of its
time to its FLOP floor (matmul FLOPs of the algorithm over a matmul rate measured in the same run).

    python -m linattn_tools.benchmark.attention                # the full sweep (~20 min on 2 cores)
    python -m linattn_tools.benchmark.attention --quick --json /tmp/a.json
    python -m linattn_tools.benchmark.attention --from-json docs/benchmarks/attention.json --docs docs/benchmarks.md
    python -m linattn_tools.benchmark.attention --dtype bfloat16 --tokens-per-step 32768 --impl fused  # a GPU

One call = forward + ``torch.autograd.grad`` of the output w.r.t. q, k, v (and LAVO's bases and
bias), fp32 by default (``--dtype``: the training dtype). ``--tokens-per-step T``: B = T // N at each N. Each
point records the implementation its op ran (``impls.implementation_for``: ``auto``'s choice; ``fused``,
named, stops with the reasons where its kernels cannot take the inputs), printed with SDPA's achieved TFLOP/s.
Time: CUDA events on a GPU. Memory: see ``linattn_tools.benchmark.measure``.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from linattn import ops
from linattn.ops.impls import IMPLS, implementation_for, resolve_impl
from linattn_tools.benchmark import cli, flops, measure, report, sweep
from linattn_tools.benchmark.dispatch import count_dispatch
from linattn_tools.methods_extra import benchmarked

# the registry's methods, and block softmax (LLN+Diag's Diag part) beside them (linattn_tools.methods_extra)
OPS = benchmarked()
METHODS = tuple(OPS)
CAUSAL = {name for name, op in OPS.items() if op.causal}
LINEAR = tuple(name for name, op in OPS.items() if not op.quadratic)  # linear time: the FLOP-floor table
DEFAULT_JSON = ROOT / "docs" / "benchmarks" / "attention.json"
# memory targets of the allocation-light ops: peak memory above the inputs at most this many times SDPA's
# (same N, same causality)
MEMORY_TARGETS = {"lln": 1.25, "lln causal": 1.25, "lln_diag": 1.25, "lln_diag causal": 1.25, "lavo": 1.25,
                  "lavo causal": 1.25, "skyformer": 1.5}
PARALLEL_MEMORY_LIMIT = 3.0  # the parallel implementation's peak at N = 16384 over SDPA's (docs/design.md §1.3)
DEFAULT_PLOT = ROOT / "docs" / "img" / "benchmark_attention.png"
QUICK = dict(sizes=[64, 128], heads=2, head_dim=16, repeats=1, min_repeats=1, warmup=1, point_seconds=1.0,
             chunk_size=16, block_size=16, lavo_window=16, lavo_bases=8, landmarks=16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="B = this // N (at least 1) at each N, e.g. 32768 (the fused kernels' targets); "
                        "default --batch")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--modes", nargs="+", choices=["non-causal", "causal"], default=["non-causal", "causal"])
    p.add_argument("--chunk-size", type=int, default=64, help="causal LLN chunk")
    p.add_argument("--block-size", type=int, default=64, help="LLN+Diag / block softmax block")
    p.add_argument("--lavo-window", type=int, default=64)
    p.add_argument("--lavo-bases", type=int, default=64)
    p.add_argument("--landmarks", type=int, default=128, help="Skyformer landmarks")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="implementation of the linear ops: parallel (GPU-shaped), looped (CPU), fused (Triton "
                        "kernels where a method has them, else parallel), auto (by device)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per point (median reported)")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--point-seconds", type=float, default=30.0,
                   help="fewer repeats (not below --min-repeats) when they would take longer than this")
    p.add_argument("--time-budget", type=float, default=60.0, help="seconds per call; a method stops above it")
    p.add_argument("--memory-budget-gib", type=float, default=8.0, help="a method stops above this peak")
    p.add_argument("--no-memory", action="store_true", help="skip the (profiled) memory measurement")
    p.add_argument("--fit-range", type=int, nargs=2, default=[4096, 32768], help="N range of the exponents")
    p.add_argument("--isolate", action="store_true",
                   help="measure each series in a process of its own (with --malloc both: its keep times right "
                        "after it), so that no other op's allocations, and no drift of the machine between the "
                        "two allocators' runs, enter its times")
    cli.add_output_arguments(p, "attention", DEFAULT_JSON, DEFAULT_PLOT, malloc_default="both")
    return cli.finish_args(p.parse_args(argv), QUICK, DEFAULT_JSON, DEFAULT_PLOT)


def make_inputs(n: int, args, device, dtype) -> dict:
    """q, k, v ~ N(0, 1) (B, H, N, D) needing grad, LLN's moment-matched alpha, beta for sigma = 1,
    LAVO's orthogonal bases and zero bias as parameters, and a fixed output gradient."""
    g = torch.Generator(device="cpu").manual_seed(n)
    shape = (batch_size(n, args), args.heads, n, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))
    alpha, beta = (float(x) for x in ops.lln_alpha_beta(torch.tensor(1.0), torch.tensor(1.0)))
    bases = ops.lavo_init_bases(args.heads, args.lavo_bases, args.head_dim).to(device, dtype)
    pos_bias = torch.zeros(args.heads, 2 * args.lavo_window - 1, device=device, dtype=dtype)
    return {"qkv": [t.requires_grad_() for t in (q, k, v)], "grad": grad, "alpha": alpha, "beta": beta,
            "lavo": [bases.requires_grad_(), pos_bias.requires_grad_()]}


def batch_size(n: int, args) -> int:
    """B at length n: ``--tokens-per-step`` // n (at least 1), else ``--batch``."""
    return max(1, args.tokens_per_step // n) if args.tokens_per_step else args.batch


def forward(method: str, causal: bool, x: dict, args):
    """The op's output and the tensors its gradient is taken for (its ``benchmark_op``)."""
    if method not in OPS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    op = OPS[method]
    settings = {"alpha": x["alpha"], "beta": x["beta"], "chunk_size": args.chunk_size, "block_size": args.block_size,
                "window": args.lavo_window, "landmarks": args.landmarks, "lavo_bases": x["lavo"][0],
                "lavo_bias": x["lavo"][1], "impl": args.impl}
    out = op.benchmark_op(ops, *x["qkv"], causal, settings)
    return out, x["qkv"] + [settings[p] for p in op.benchmark_params]


def case(method: str, causal: bool, args):
    def build(n, x):
        def call():
            out, wrt = forward(method, causal, x, args)
            return torch.autograd.grad(out, wrt, x["grad"])

        def extra() -> dict:
            """ATen ops launched and host syncs of one call (a GPU launches at least one kernel per op), the
            implementation the op ran and the batch."""
            with count_dispatch() as counts:
                call()
            q = x["qkv"][0]
            return {"aten_ops": counts.launched, "host_syncs": counts.host_syncs, "batch": q.shape[0],
                    "impl": implementation_for(method, args.impl, q)}
        call.extra = extra
        return call
    return build


def series_name(method: str, causal: bool) -> str:
    return f"{method} causal" if causal else method


def title(name: str) -> str:
    """A series' name for plots: 'lln_diag causal' -> 'LLN+Diag causal' (the ops' titles)."""
    method, _, rest = name.partition(" ")
    return " ".join([OPS[method].title if method in OPS else method] + ([rest] if rest else []))


def series_list(args):
    """(name, method, causal) of every series the arguments ask for."""
    return [(series_name(m, mode == "causal"), m, mode == "causal") for mode in args.modes for m in args.methods
            if mode != "causal" or m in CAUSAL]


def measure_isolated(args) -> dict:
    """Each series measured by a child process of this script (``--isolate``), the results merged."""
    base = cli.child_argv(sys.argv[1:], cli._OUTPUTS + ("--methods", "--modes"), ("--isolate",))
    parts = []
    for name, method, causal in series_list(args):
        print(f"[isolate] {name}", flush=True)
        parts.append(cli.run_child(base + ["--malloc", args.malloc, "--methods", method,
                                           "--modes", "causal" if causal else "non-causal"]))
    rates = {}
    for part in parts:
        for n, rate in part["matmul_flops"].items():
            rates.setdefault(n, []).append(rate)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"config": config, "machine": parts[0]["machine"], "load_start": parts[0]["load_start"],
            "load_end": parts[-1]["load_end"], "series": {k: v for p in parts for k, v in p["series"].items()},
            "points": {k: v for p in parts for k, v in p["points"].items()},
            "matmul_flops": {n: sorted(r)[len(r) // 2] for n, r in rates.items()}}


def measure_all(args) -> dict:
    if args.isolate:
        return measure_isolated(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases, meta = {}, {}
    for name, method, causal in series_list(args):
        cases[name] = case(method, causal, args)
        meta[name] = {"method": method, "causal": causal}
    load = measure.load_average()
    machine = measure.machine_info(device)
    result = sweep.run(cases, args.sizes, device, setup=lambda n: make_inputs(n, args, device, dtype),
                       time_budget=args.time_budget, memory_budget=args.memory_budget_gib * 2 ** 30,
                       warmup=args.warmup, repeats=args.repeats, min_repeats=args.min_repeats,
                       point_seconds=args.point_seconds, measure_memory=not args.no_memory)
    print_implementations_and_sdpa_rate(result["points"], meta, args)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"config": config, "machine": machine, "load_start": load, "load_end": measure.load_average(),
            "series": meta, "points": result["points"],
            "matmul_flops": {str(n): rate for n, rate in result["matmul_flops"].items()}}


def print_implementations_and_sdpa_rate(points: dict, meta: dict, args) -> None:
    """One line per series: the implementation its op ran at each N; for SDPA, its achieved TFLOP/s."""
    for name, rows in points.items():
        ran = sorted({r["impl"] for r in rows if "impl" in r})
        print(f"{name}: implementation {', '.join(ran) or 'n/a'}", flush=True)
        if name != series_name("softmax", meta[name]["causal"]):
            continue
        for r in rows:
            if r["status"] == "ok":
                work = step_flops(vars(args), meta[name]["method"], meta[name]["causal"], r)
                print(f"  N={r['n']}, B={r.get('batch', args.batch)}: SDPA {work / r['median_s'] / 1e12:.3f} "
                      "TFLOP/s", flush=True)


def floor_ratio(res: dict, name: str, row: dict) -> float:
    """Measured time over the FLOP floor (training matmul FLOPs / the matmul rate at that N)."""
    m = res["series"][name]
    work = step_flops(res["config"], m["method"], m["causal"], row)
    return row["median_s"] / (work / res["matmul_flops"][str(row["n"])])


def step_flops(c: dict, method: str, causal: bool, row: dict) -> float:
    """Matmul FLOPs of one forward + backward at a row's N and batch, under the run's config ``c``."""
    opts = {"chunk_size": c["chunk_size"], "block_size": c["block_size"], "window": c["lavo_window"],
            "bases": c["lavo_bases"], "landmarks": c["landmarks"]}  # the names flops.forward_flops reads
    return flops.training_flops(method, row["n"], row.get("batch", c["batch"]), c["heads"], c["head_dim"],
                                causal=causal, opts=opts)


def _row(res: dict, name: str, n: int):
    for r in res["points"].get(name, []):
        if r["n"] == n and r["status"] == "ok":
            return r
    return None


def _target_list():
    """An empty target list and the function that appends one target to it."""
    out = []

    def add(text, value, ok, fmt="{:.1f}×"):
        out.append({"target": text, "measured": "n/a" if value is None else fmt.format(value),
                    "met": value is not None and ok(value)})
    return out, add


def targets(res: dict) -> list:
    """The targets of the run's implementation (``parallel_targets`` or the CPU implementation's below)."""
    c = res["config"]
    if resolve_impl(c.get("impl", "looped"), torch.device(c["device"])) == "parallel":
        return parallel_targets(res)
    return looped_targets(res)


def parallel_targets(res: dict) -> list:
    """The parallel implementation's budgets (docs/design.md §1.3): peak memory at N = 16384 at most
    ``PARALLEL_MEMORY_LIMIT``× SDPA's (same causality), and ATen ops per call that do not grow from N = 4096 to
    16384 (≤ 1.25×), for every op beside SDPA (n/a when a point is missing)."""
    out, add = _target_list()
    for name in res["points"]:
        base = series_name("softmax", res["series"][name]["causal"])
        if name == base:
            continue
        ours, sdpa = _row(res, name, 16384), _row(res, base, 16384)
        peaks = None if not (ours and sdpa and ours.get("peak_bytes") and sdpa.get("peak_bytes")) else (
            ours["peak_bytes"] / sdpa["peak_bytes"])
        add(f"{name}: peak memory ≤ {PARALLEL_MEMORY_LIMIT:g}× SDPA's at N=16384", peaks,
            lambda x: x <= PARALLEL_MEMORY_LIMIT, "{:.2f}×")
        small, large = _row(res, name, 4096), _row(res, name, 16384)
        growth = None if not (small and large and small.get("aten_ops") and large.get("aten_ops")) else (
            large["aten_ops"] / small["aten_ops"])
        add(f"{name}: ATen ops per call at N=16384 ≤ 1.25× those at N=4096", growth, lambda x: x <= 1.25,
            "{:.2f}×")
    return out


def looped_targets(res: dict) -> list:
    """The CPU implementation's targets (speed-ups against SDPA, ``MEMORY_TARGETS``, the time cost of glibc's default
    allocator) on this machine, from the measured medians (n/a when a point is missing)."""
    out, add = _target_list()

    def ratio(a, b, n):
        """time of b / time of a: the speed-up of a over b."""
        ra, rb = _row(res, a, n), _row(res, b, n)
        return None if ra is None or rb is None else rb["median_s"] / ra["median_s"]

    add("non-causal LLN at N=8192 ≥ 30× faster than SDPA", ratio("lln", "softmax", 8192), lambda x: x >= 30)
    row = _row(res, "lln", 8192)
    add("non-causal LLN at N=8192 within 3× of its FLOP floor",
        None if row is None else floor_ratio(res, "lln", row), lambda x: x <= 3, "{:.2f}×")
    add("causal LLN at N=8192 ≥ 15× faster than causal SDPA", ratio("lln causal", "softmax causal", 8192),
        lambda x: x >= 15)
    lo, hi = res["config"]["fit_range"]
    add(f"causal LLN memory exponent over N={lo}–{hi} ≤ 1.1",
        report.scaling_exponent(res["points"].get("lln causal", []), "peak_bytes", lo, hi), lambda x: x <= 1.1,
        "{:.2f}")
    for suffix in ("", " causal"):
        add(f"LLN+Diag{suffix} at N=8192 ≤ 1.25× LLN{suffix} (time ratio)",
            ratio("lln" + suffix, "lln_diag" + suffix, 8192), lambda x: x <= 1.25, "{:.2f}×")
    add("Skyformer (128 landmarks) at N=8192 ≥ 15× faster than SDPA", ratio("skyformer", "softmax", 8192),
        lambda x: x >= 15)
    add("causal LAVO (w=64, r=64) at N=16384 ≥ 25× faster than causal SDPA",
        ratio("lavo causal", "softmax causal", 16384), lambda x: x >= 25)
    big = [n for n in res["config"]["sizes"] if 4096 <= n <= 32768]
    for name, limit in MEMORY_TARGETS.items():
        base = "softmax causal" if name.endswith("causal") else "softmax"
        pairs = [(_row(res, name, n), _row(res, base, n)) for n in big]
        worst = [a["peak_bytes"] / b["peak_bytes"] for a, b in pairs
                 if a and b and a.get("peak_bytes") and b.get("peak_bytes")]
        span = f"{big[0] if big else 4096}–{big[-1] if big else 32768}"
        add(f"{name}: peak memory ≤ {limit}× SDPA's at N={span} (worst N)",
            max(worst) if worst else None, lambda x, limit=limit: x <= limit, "{:.2f}×")
    for name in MEMORY_TARGETS:
        rows = [_row(res, name, n) for n in (16384, 32768)]
        slow = [r["median_s"] / r["keep_median_s"] for r in rows if r and r.get("keep_median_s")]
        add(f"{name}: time with glibc's defaults ≤ 1.5× with --malloc keep at N=16384, 32768 (worst N)",
            max(slow) if slow else None, lambda x: x <= 1.5, "{:.2f}×")
    return out


def batch_text(c: dict) -> str:
    """The batch of a run's config: a number, or ``T // N`` under ``--tokens-per-step``."""
    return f"{c['tokens_per_step']} // N" if c.get("tokens_per_step") else str(c["batch"])


def render(res: dict, image: str) -> str:
    """The results section: machine, settings, targets, then time, memory, speed-up and FLOP-floor tables."""
    c = res["config"]
    sizes = c["sizes"]
    lo, hi = c["fit_range"]
    pts = res["points"]
    exps = {name: {f"exponent N={lo}–{hi}": report.fmt_exponent(report.scaling_exponent(rows, "median_s", lo, hi))}
            for name, rows in pts.items()}
    mem_exps = {name: {f"exponent N={lo}–{hi}": report.fmt_exponent(report.scaling_exponent(rows, "peak_bytes",
                                                                                             lo, hi))}
                for name, rows in pts.items()}
    keep = any("keep_median_s" in r for rows in pts.values() for r in rows)
    time_table = report.table(pts, sizes, lambda r: f"{r['median_s'] * 1e3:.1f}" + (
        f" ({r['keep_median_s'] * 1e3:.1f})" if "keep_median_s" in r else ""), exps)
    time_title = ("**Forward + backward time (ms), glibc's default allocator (in brackets: `--malloc keep`)**"
                  if keep else "**Forward + backward time (ms)**")
    mem_table = report.table(pts, sizes, lambda r: None if r.get("peak_bytes") is None
                             else f"{r['peak_bytes'] / report.MiB:.1f}", mem_exps)
    floor = {name: [dict(r, floor=floor_ratio(res, name, r)) if r["status"] == "ok" else r for r in rows]
             for name, rows in pts.items() if res["series"][name]["method"] in LINEAR}
    floor_table = report.table(floor, sizes, lambda r: f"{r['floor']:.2f}")
    speed = {}
    for name, rows in pts.items():
        base = "softmax causal" if res["series"][name]["causal"] else "softmax"
        if name != base and base in pts:
            speed[name] = [dict(r, speedup=_row(res, base, r["n"])["median_s"] / r["median_s"])
                           if r["status"] == "ok" and _row(res, base, r["n"]) else r for r in rows]
    speed_table = report.table(speed, sizes, lambda r: f"{r['speedup']:.1f}" if "speedup" in r else "n/a")
    rates = ", ".join(f"{int(n)}: {rate / 1e9:.0f}" for n, rate in res["matmul_flops"].items())
    counted = any("aten_ops" in r for rows in pts.values() for r in rows)
    ops_table = report.table(pts, sizes, lambda r: None if "aten_ops" not in r else
                             f"{r['aten_ops']}" + (f" ({r['host_syncs']} syncs)" if r["host_syncs"] else ""))
    return "\n\n".join([
        report.machine_lines(res["machine"], res["load_start"]) +
        f" Load at the end: {', '.join(f'{x:.2f}' for x in res['load_end'])}.",
        f"B={batch_text(c)}, H={c['heads']}, D={c['head_dim']}, {c['dtype']}; one call = forward + gradient "
        f"w.r.t. q, k, v; median of {c['min_repeats']}–{c['repeats']} calls after {c['warmup']} warm-up; "
        f"budget {c['time_budget']:g} s per call and {c['memory_budget_gib']:g} GiB. Options: causal LLN "
        f"chunk {c['chunk_size']}, blocks {c['block_size']}, LAVO w={c['lavo_window']} r={c['lavo_bases']}, "
        f"Skyformer {c['landmarks']} landmarks; implementation `--impl {c.get('impl', 'looped')}`. "
        "\"skipped\": the last two points predicted more than the budget.",
        f"![attention benchmark: time and memory against N]({image})" if image else "",
        "**Targets**\n\n" + report.targets_table(targets(res)),
        time_title + "\n\n" + time_table,
        "**Peak memory above the inputs (MiB)**\n\n" + mem_table,
        "**Speed-up over SDPA (softmax; causal over causal)**\n\n" + speed_table,
        "**Time over FLOP floor** (matmul FLOPs of forward+backward / matmul rate; rate in GFLOP/s at each "
        f"N: {rates})\n\n" + floor_table,
    ] + (["**ATen ops launched per call** (each is at least one kernel launch on a GPU; host syncs in "
          "brackets)\n\n" + ops_table] if counted else []))


def plot(res: dict, path: Path) -> None:
    c = res["config"]
    titled = {title(name): rows for name, rows in res["points"].items()}
    report.plot_loglog(titled, path, f"attention forward+backward, B={batch_text(c)}, H={c['heads']}, "
                       f"D={c['head_dim']}, {c['dtype']}")


def main(argv=None):
    cli.run(parse_args(argv), argv, "attention results", measure_all, plot, render)


if __name__ == "__main__":
    main()

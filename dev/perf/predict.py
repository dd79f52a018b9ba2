"""A predicted H100 time for each fused module step of the targets (docs/benchmarks.md), from CPU proxies: each
kernel launch of the step (``dev.perf.launches``: grid, tensors, options, recorded at the target's shape under
Triton's interpreter) and each kernel's sm_90 binary (``dev.perf.kernel_resources``: registers, spills, blocks an
SM holds, tensor-core FLOPs and FFMAs).

A launch's time is max(bytes / HBM, tensor FLOPs / tensor rate, fp32 FLOPs / fp32 rate, spilled bytes / L2), over
the efficiency ``eta`` and the share of the GPU its grid keeps busy (SMs busy over its waves, and occupancy below
``OCCUPANCY_SATURATION`` taken as proportionally less bandwidth), plus ``t_iter`` an iteration of a walk's serial
loop (``WALKS``) and a launch's overhead. The step: the kernels, plus what is not a kernel of ours (the projections,
the bias sums, what SDPA's step also pays: the intercept of the softmax module's measured step times against N,
less the former loss for the current step), or the host's time to issue it if longer
(docs/benchmarks/host_time.json). ``eta`` and ``t_iter`` are fitted to the fused causal LLN rows of the measured H100
table (docs/benchmarks/gpu_targets_h100.json, kernels at commit 3a9230f) with that commit's launches (recorded from
its tree) and the nearest binaries on record (f532fa9's, the same LLN kernels' products in exact fp32, built without
the launches' specialisation). The non-causal rows are left out of the fit: their ``_state_grad`` ran at 4 warps,
which made the op 3.1x slower than at 8 in the tuning run, and the binaries on record have it at 8 only.

    git archive 3a9230f | tar -x -C /tmp/old && LINATTN_TRITON_LAUNCH='{"lln_noncausal_state_grad": {"num_warps": 4}}'
        python -m dev.perf.launches --root /tmp/old --series lln lln:causal --n 2048 4096 16384 32768 --json then.json
    python -m dev.perf.launches --series lln lln:causal lln_diag lln_diag:causal skyformer lavo:causal
        --n 2048 4096 16384 32768 --json now.json
    python -m dev.perf.launches --series lln lln:causal lln_diag lln_diag:causal skyformer lavo:causal
        --n 2048 4096 16384 32768 --d 128 --json now128.json
    python -m dev.perf.predict --launches now.json --then then.json --grids-128 now128.json
        --json docs/benchmarks/predicted_h100.json

``--grids-128``: the same steps at head size 128 (H = 6), whose grids are kept (``grids``: each launch's LAUNCH key,
causality and programs) for the occupancy proxies at D = 128 (``tests/devtools/test_predict.py``), not predicted.
"""
import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
# an H100 SXM: SMs, HBM3's bandwidth, L2's, dense fp16 tensor-core and fp32 rates, a launch's device-side cost
H100 = dict(sms=132, hbm_bytes_s=3.35e12, l2_bytes_s=5.5e12, tensor_flop_s=989e12, fp32_flop_s=67e12, launch_s=3e-6)
OCCUPANCY_SATURATION = 0.25  # warps resident over 64 from which an SM's memory traffic is taken as saturated
LOSS_S = 0.69e-3  # the loss the measured steps took and the current step does not (its byte floor, docs)
THEN = "3a9230f"
FITTED = (("lln", True),)  # the measured series the two factors are fitted to (the non-causal: above)
# the kernels that walk the chunks serially in each program
WALKS = ("linattn.ops.triton.lln_causal._states", "linattn.ops.triton.lln_causal_backward._grad_states")
BUILDS_APART = ("ENDS", "FOLD")  # the constexprs that make one kernel function's launches builds of two LAUNCH keys


def walk_trips(call: dict) -> int:
    """The serial steps of a ``WALKS`` launch: NC chunks; walked in segments of SEG chunks (``common.walk_grid``),
    SEG (the ends) or a step a segment before its own and SEG."""
    if call["function"] not in WALKS:
        return 0
    args = {k: a.get("value") for k, a in call["args"].items()}
    if not args.get("SEG"):
        return args["NC"]
    return args["SEG"] if call["constexprs"].get("ENDS") else -(-args["NC"] // args["SEG"]) - 1 + args["SEG"]


def grids(runs: List[dict], keys: Dict[str, str]) -> List[dict]:
    """Per target series and N of ``dev.perf.launches`` runs, each launch's LAUNCH key, causality and programs."""
    from linattn_tools.benchmark.targets import TARGETS
    return [dict(method=r["method"], causal=r["causal"], n=r["n"], d=r["d"], heads=r["heads"],
                 launches=[dict(key=launch_key(c, keys), causal=c["constexprs"].get("CAUSAL"),
                                programs=math.prod(c["grid"])) for c in r["launches"]])
            for r in runs if (r["method"], r["causal"]) in TARGETS]


def summarise(call: dict) -> dict:
    """A recorded launch's grid, programs, warps, the bytes of its distinct tensors (each read or written once, at
    its view's elements) and its serial loop's trips (``WALKS``)."""
    seen, nbytes = set(), 0
    for arg in call["args"].values():
        t = arg.get("tensor")
        if t and (t["ptr"], tuple(t["shape"])) not in seen:
            seen.add((t["ptr"], tuple(t["shape"])))
            nbytes += math.prod(t["shape"]) * t["itemsize"]
    return dict(function=call["function"], grid=call["grid"], programs=math.prod(call["grid"]),
                num_warps=call["options"].get("num_warps", 4), bytes=nbytes,
                trips=walk_trips(call), causal=call["constexprs"].get("CAUSAL"))


def kernel_time(launch: dict, row: dict, eta: float, t_iter: float, gpu: dict = H100) -> dict:
    """``launch`` (``summarise``) on ``gpu`` with the binary ``row`` (``kernel_resources``): each term's seconds,
    waves, SMs busy, occupancy, and the predicted ``time_s``."""
    programs, threads = launch["programs"], row["num_warps"] * 32
    tensor = row.get("tensor_flops", row["tensor_core"] * 2 * 64 * 64 * 16 * max(1, row["num_warps"] // 4)) * programs
    fp32 = row["ffma"] * 2 * threads * programs
    spill = row["local_bytes"] * threads * programs
    terms = dict(hbm_s=launch["bytes"] / gpu["hbm_bytes_s"], tensor_s=tensor / gpu["tensor_flop_s"],
                 fp32_s=fp32 / gpu["fp32_flop_s"], spill_s=spill / gpu["l2_bytes_s"])
    slots = row["blocks_per_sm"] * gpu["sms"]
    waves = -(-programs // slots)
    if not waves:  # an empty grid (a walk's ends in one segment): Triton launches nothing
        return dict(**terms, tensor_flops=0, fp32_flops=0, spill_bytes=0, blocks_per_sm=row["blocks_per_sm"], waves=0,
                    sms_busy=0.0, occupancy=0.0, serial_s=0.0, time_s=0.0, bound="none")
    last = programs - (waves - 1) * slots
    busy = ((waves - 1) + min(last, gpu["sms"]) / gpu["sms"]) / waves
    resident = min(row["blocks_per_sm"], -(-programs // gpu["sms"]))
    occupancy = resident * row["num_warps"] / 64
    share = busy * min(1.0, occupancy / OCCUPANCY_SATURATION)
    serial = launch["trips"] * t_iter
    time_s = max(terms.values()) / (eta * share) + serial + gpu["launch_s"]
    return dict(**terms, tensor_flops=tensor, fp32_flops=fp32, spill_bytes=spill, blocks_per_sm=row["blocks_per_sm"],
                waves=waves, sms_busy=busy, occupancy=occupancy, serial_s=serial, time_s=time_s,
                bound=max(terms, key=terms.get))


def rows_by_key(resources: dict) -> Dict[tuple, dict]:
    """fp16, D = 64 rows at LAUNCH's settings by (LAUNCH key, causality or None), blocks an SM holds filled in for
    rows of an older tool."""
    from dev.perf.kernel_resources import occupancy
    out = {}
    for row in resources["rows"]:
        if row["dtype"] == "fp16" and row["d"] == 64 and not row["change"]:
            if "blocks_per_sm" not in row:
                row = {**row, **occupancy(row["registers"], row["num_warps"], row["shared_bytes"])}
            out[(row["kernel"], row["causal"])] = row
    return out


def function_keys() -> Dict[tuple, str]:
    """Each kernel build's LAUNCH key by its function and ``BUILDS_APART`` constexprs (``kernel_resources.kernels``:
    the walk's ends and the moment matcher's fold are builds of their own)."""
    import triton.language as tl

    from dev.perf.kernel_resources import kernels
    from dev.perf.launches import function
    return {(function(kernel.fn), *(bool(c.get(n)) for n in BUILDS_APART)): key
            for kernel, key, c in kernels(tl.float16)}


def launch_key(call: dict, keys: Dict[tuple, str]) -> str:
    """The LAUNCH key of a recorded launch (``function_keys``; a constexpr an earlier tree's kernel lacks: false)."""
    return keys[(call["function"], *(bool(call["constexprs"].get(n)) for n in BUILDS_APART))]


def find_row(key: str, causal: Optional[bool], rows: Dict[tuple, dict]) -> dict:
    """The binary of ``key`` built for ``causal`` where it has one, else its only one (the block softmax's: causal)."""
    return rows.get((key, causal)) or next(r for (k, _), r in rows.items() if k == key)


def softmax_fit(measured: List[dict]) -> Dict[bool, Tuple[float, float]]:
    """Per causality, (intercept s, slope s a token of N) of the softmax module's measured fp16 steps against N: the
    intercept is what its step pays besides attention (projections, bias sums, the loss then)."""
    fits = {}
    for causal in (False, True):
        pts = [(r["n"], r["median_s"]) for r in measured if r["method"] == "softmax" and r["causal"] == causal]
        mx, my = sum(n for n, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
        slope = sum((n - mx) * (t - my) for n, t in pts) / sum((n - mx) ** 2 for n, _ in pts)
        fits[causal] = (my - slope * mx, slope)
    return fits


def predict_step(launches: List[dict], rows, keys, eta: float, t_iter: float, other_s: float, host_s: float,
                 gpu: dict = H100) -> dict:
    """One step's kernels (``kernel_time`` each), its device time (theirs and ``other_s``), the predicted time (that
    or ``host_s``, the longer) and its floor: ``other_s`` and the kernels' bytes at the whole HBM bandwidth, what no
    kernel of ours can beat (each tensor read or written once)."""
    kernels = []
    for call in launches:
        launch = summarise(call)
        row = find_row(launch_key(call, keys), launch["causal"], rows)
        kernels.append(dict(launch, key=row["kernel"], registers=row["registers"],
                            **kernel_time(launch, row, eta, t_iter)))
    device = sum(k["time_s"] for k in kernels) + other_s
    floor = sum(k["bytes"] for k in kernels) / gpu["hbm_bytes_s"] + other_s
    return dict(predicted_s=max(device, host_s), device_s=device, host_s=host_s, other_s=other_s, floor_s=floor,
                kernels=kernels)


def calibrate(runs: List[dict], measured: Dict[tuple, float], rows, keys, other: Dict[bool, float],
              host: Dict[tuple, float]) -> Tuple[float, float]:
    """(eta, t_iter) that minimise the squared log error of the predicted steps of ``runs`` against ``measured``
    (a grid over eta in [0.02, 1] and t_iter in [0, 10] µs, then refined)."""
    runs = [r for r in runs if (r["method"], r["causal"]) in FITTED]

    def loss(eta, t_iter):
        return sum(math.log(predict_step(r["launches"], rows, keys, eta, t_iter, other[r["causal"]],
                                         host[(r["method"], r["causal"])])["predicted_s"]
                            / measured[(r["method"], r["causal"], r["n"])]) ** 2 for r in runs)
    best = min(((eta, t) for eta in [0.02 * 1.1 ** i for i in range(42)] for t in [i * 0.25e-6 for i in range(41)]),
               key=lambda p: loss(*p))
    for _ in range(3):
        e0, t0 = best
        best = min(((e0 * 1.02 ** i, max(0.0, t0 + j * 0.02e-6)) for i in range(-5, 6) for j in range(-6, 7)),
                   key=lambda p: loss(*p))
    return best


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def main(argv: Optional[List[str]] = None) -> int:
    from linattn_tools.benchmark.targets import SIZES, TARGETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", required=True, help="dev.perf.launches --json of the current tree at the targets")
    p.add_argument("--then", required=True, help=f"dev.perf.launches --json of {THEN}'s tree (--root), LLN only")
    p.add_argument("--resources", default=str(DOCS / "kernel_resources_sm90_triton3.6.json"))
    p.add_argument("--resources-then", default=str(DOCS / "kernel_resources_sm90_f532fa9.json"))
    p.add_argument("--measured", default=str(DOCS / "gpu_targets_h100.json"))
    p.add_argument("--grids-128", help="dev.perf.launches --json of the current tree at the targets, --d 128")
    p.add_argument("--json", help="write the prediction here")
    args = p.parse_args(argv)
    measured_rows = [r for r in json.loads(Path(args.measured).read_text())["runs"]["fused_chunk_parallel"]["rows"]
                     if r["dtype"] == "float16"]
    measured = {(r["method"], r["causal"], r["n"]): r["median_s"] for r in measured_rows}
    fits = softmax_fit(measured_rows)
    keys = function_keys()

    def hosts(name):
        return {(r["method"], r["causal"]): r["host_s"] for r in json.loads((DOCS / name).read_text())["rows"]}
    then_rows, now_rows = (rows_by_key(json.loads(Path(f).read_text())) for f in (args.resources_then, args.resources))
    then_runs = json.loads(Path(args.then).read_text())["runs"]
    other_then = {c: fits[c][0] for c in fits}
    other_now = {c: max(0.0, fits[c][0] - LOSS_S) for c in fits}
    eta, t_iter = calibrate(then_runs, measured, then_rows, keys, other_then, hosts("host_time_8db0e03.json"))
    calibration = []
    for r in then_runs:
        step = predict_step(r["launches"], then_rows, keys, eta, t_iter, other_then[r["causal"]],
                            hosts("host_time_8db0e03.json")[(r["method"], r["causal"])])
        got = measured[(r["method"], r["causal"], r["n"])]
        calibration.append(dict(method=r["method"], causal=r["causal"], n=r["n"], measured_s=got,
                                predicted_s=step["predicted_s"], error=step["predicted_s"] / got - 1,
                                fitted=(r["method"], r["causal"]) in FITTED,
                                kernels=step["kernels"]))
    host_now = hosts("host_time.json")
    now_runs = [r for r in json.loads(Path(args.launches).read_text())["runs"]  # the targets' series (the recorder's
                if (r["method"], r["causal"]) in TARGETS]  # default also has LAVO non-causal, for the specialisation)
    predictions = []
    for r in now_runs:
        step = predict_step(r["launches"], now_rows, keys, eta, t_iter, other_now[r["causal"]],
                            host_now[(r["method"], r["causal"])])
        softmax = measured[("softmax", r["causal"], r["n"])] - LOSS_S
        predictions.append(dict(method=r["method"], causal=r["causal"], n=r["n"], batch=r["batch"], **step,
                                softmax_s=softmax, ratio=step["predicted_s"] / softmax,
                                floor_ratio=step["floor_s"] / softmax,
                                target=TARGETS[(r["method"], r["causal"])][SIZES.index(r["n"])],
                                measured_then_s=measured.get((r["method"], r["causal"], r["n"])),
                                impl_then=next((m["impl"] for m in measured_rows if (m["method"], m["causal"], m["n"])
                                                == (r["method"], r["causal"], r["n"])), None)))
    print(markdown(calibration, predictions))
    if args.json:
        resources = json.loads(Path(args.resources).read_text())
        Path(args.json).write_text(json.dumps(dict(
            commit=commit(), triton=resources["triton"], hints=resources.get("hints", False), gpu=H100,
            occupancy_saturation=OCCUPANCY_SATURATION, loss_s=LOSS_S, eta=eta, t_iter_s=t_iter,
            other_s={str(c).lower(): v for c, v in other_now.items()},
            softmax_fit={str(c).lower(): dict(intercept_s=a, slope_s=b) for c, (a, b) in fits.items()},
            calibration=dict(commit=THEN, resources=Path(args.resources_then).name, rows=calibration),
            predictions=predictions,
            grids_128=grids(json.loads(Path(args.grids_128).read_text())["runs"], keys) if args.grids_128 else None),
            indent=1) + "\n")
    return 0


def markdown(calibration: List[dict], predictions: List[dict]) -> str:
    then = {(c["method"], c["causal"], c["n"]): c for c in calibration}
    lines = ["| series | N | measured at 3a9230f (impl) | predicted at 3a9230f (error) | predicted now | now / softmax"
             " | floor / softmax | target |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(predictions, key=lambda p: (p["method"], p["causal"], p["n"])):
        c = then.get((p["method"], p["causal"], p["n"]))
        got = f"{p['measured_then_s'] * 1e3:.1f} ms (`{p['impl_then']}`)" if p["measured_then_s"] else "–"
        fit = f"{c['predicted_s'] * 1e3:.1f} ms ({c['error']:+.0%})" if c else "–"
        ok = "✓" if p["ratio"] <= p["target"] else "✗"
        lines.append(f"| {p['method']}{' causal' * p['causal']} | {p['n']} | {got} | {fit} | "
                     f"{p['predicted_s'] * 1e3:.2f} ms | {p['ratio']:.2f}× {ok} | {p['floor_ratio']:.2f}× | "
                     f"≤ {p['target']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

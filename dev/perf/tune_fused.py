"""Launch settings of the fused kernels on this GPU: a check against the float64 references, then a greedy search
(one kernel at a time, the others at their best so far) over warps, pipeline stages, block sizes and the precision
of the unbounded products, timing the kernel family's op forward + backward (CUDA events, median) at the training
shapes (docs/design.md §1.3.1). Families: LLN, the block softmax (LLN+Diag), Skyformer, LAVO (``fused_ops``).

    python -m dev.perf.tune_fused --json runs/tune_fused.json --env runs/tune_fused.env
    set -a; . runs/tune_fused.env; set +a          # later commands in this shell run the best settings

The best settings found go into ``linattn/ops/triton/common.py``'s ``LAUNCH`` by hand, with the card they were
measured on; ``LINATTN_TRITON_LAUNCH`` applies them to a run without editing it.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from linattn.ops.triton import common, lln_noncausal
from linattn.tolerances import tolerance
from linattn_tools.benchmark import measure
from linattn_tools.benchmark.cli import write_json

from . import fused_ops

# (B, N) at 32K tokens a step, H = 12, D = Dv = 64 (the targets' shapes, docs/design.md §1.3)
SHAPES = ((8, 4096), (1, 32768))
EXACT = dict(TF32=False)  # the unbounded operands' products as exact fp32 FMAs, not tf32 (spills: kernel_resources)
TF32X3 = dict(TF32="x3")  # in three tf32 products on tensor cores, close to fp32's accuracy
CANDIDATES = {  # per kernel: the settings tried besides LAUNCH's own
    "lln_key_max": [dict(num_warps=w) for w in (2, 8)],
    "lln_causal_states": [dict(BF=f, num_warps=w, num_stages=2) for f in (16, 32) for w in (2, 4)]
    + [dict(BV=32), dict(BV=32, num_warps=2)],
    "lln_causal_outputs": [dict(num_warps=8), EXACT, TF32X3],
    "lln_causal_grad_states": [dict(num_warps=8), dict(BF=32), dict(BV=32), EXACT, TF32X3],
    "lln_causal_grads": [dict(BF=32, num_warps=8), dict(BF=32), dict(num_stages=2), EXACT, TF32X3],
    "lln_noncausal_state": [dict(num_warps=8), dict(num_stages=3)],
    "lln_noncausal_readout": [dict(num_warps=4)],  # its products take bounded half operands: no TF32 setting
    "lln_noncausal_state_grad": [dict(num_warps=4), dict(num_stages=3)],
    "lln_noncausal_rows_grad": [dict(num_warps=8), EXACT, TF32X3],
    "block_softmax": [dict(num_warps=8), dict(num_stages=2)],
    "block_softmax_backward": [dict(num_warps=8), EXACT, TF32X3],
    "nystrom_state": [dict(BLOCK=64), dict(num_warps=4), dict(num_stages=3)],
    "nystrom_readout": [dict(num_warps=8), EXACT, TF32X3],
    "nystrom_rows_grad": [dict(BLOCK=32), dict(num_warps=4), EXACT, TF32X3],
    "nystrom_landmarks_grad": [dict(BLOCK=32), dict(num_warps=4), EXACT, TF32X3],
    # the d×d iteration: rows a pass (BLOCK) and warps, exact fp32 FMAs, tf32 alone (the check may refuse it)
    "nystrom_inverse": [dict(BLOCK=64, num_warps=8), dict(BLOCK=16), EXACT, dict(TF32=True)],
    "nystrom_inverse_grad": [dict(BLOCK=32), dict(BLOCK=32, num_warps=8), EXACT, dict(TF32=True)],
    "lavo_local": [dict(num_warps=8), dict(num_stages=2), dict(BLOCK=32)],
    "lavo_memory": [dict(num_warps=8), dict(BLOCK=32), EXACT, TF32X3],
    "lavo_memory_grad": [dict(num_warps=8), EXACT, TF32X3],
    "lavo_bases_grad": [dict(num_warps=8), EXACT, TF32X3],
    "lavo_local_query_grad": [dict(BLOCK=64), dict(BK=64), dict(num_warps=8), EXACT, TF32X3],
    "lavo_local_grad": [dict(BLOCK=32), dict(COLS=32), dict(num_warps=8), EXACT, TF32X3],
}
CHECK_N = 1000  # the length of ``check``: odd chunks (C = 64) and windows, several non-causal splits of 64 rows
SPLITS = (512, 1024, 2048)  # lln_noncausal.SPLIT_ROWS: rows a program of the non-causal reductions sums


def _padded(b: int, n: int, device) -> torch.Tensor:
    """(B, N): the last sequence's last eighth padded."""
    mask = torch.zeros(b, n, dtype=torch.bool, device=device)
    mask[-1, n - n // 8:] = True
    return mask


def check(dtype, device, family: str = "lln") -> List[dict]:
    """Forward and input gradients of ``family``'s op against its float64 reference at N = CHECK_N (the second
    sequence's last eighth padded; LLN's causal op unpadded), in each causality it takes: relative errors and
    the tolerance of ``linattn/tolerances.py``."""
    rows = []
    tensors = fused_ops.inputs(family, 2, CHECK_N, dtype, device, heads=4)
    q, k, v, grad = tensors[:4]
    name = str(dtype).split(".")[-1]
    method = fused_ops.FAMILIES[family].method
    for causal in fused_ops.FAMILIES[family].causal:
        mask = None if causal and not fused_ops.FAMILIES[family].causal_padded else _padded(2, CHECK_N, device)
        out = fused_ops.call(family, tensors, causal, mask)
        got = torch.autograd.grad(out, (q, k, v), grad)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = fused_ops.call(family, leaves + tensors[3:], causal, mask, impl="reference")
        want = torch.autograd.grad(ref, leaves, grad.double())
        err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
        rows.append({"family": family, "causal": causal, "dtype": name, "out": err(out, ref),
                     "grads": max(err(a, b) for a, b in zip(got, want)), "tolerance": tolerance(method, name),
                     "grad_tolerance": tolerance(method, name, gradient=True)})
    return rows


def op_seconds(family: str, causal: bool, dtype, device, repeats: int) -> float:
    """Sum over SHAPES of ``family``'s op forward + backward median time (non-causal: the last eighth padded)."""
    total = 0.0
    for b, n in SHAPES:
        tensors = fused_ops.inputs(family, b, n, dtype, device)
        mask = None if causal else _padded(b, n, device)
        run = lambda: torch.autograd.grad(fused_ops.call(family, tensors, causal, mask), tensors[:3],  # noqa: E731
                                          tensors[3])
        for _ in range(2):
            run()
        total += statistics.median(measure.elapsed_seconds(run, device) for _ in range(repeats))
    return total


def kernel_seconds(kernel: str, dtype, device, repeats: int) -> float:
    """The time ``kernel`` is tuned by: its family's op in the kernel's causality (LLN's, by name), else in each
    the family takes, summed."""
    family = fused_ops.family_of(kernel)
    causal = fused_ops.FAMILIES[family].causal
    if fused_ops.FAMILIES[family].causal_by_name:
        causal = ("noncausal" not in kernel,)
    return sum(op_seconds(family, c, dtype, device, repeats) for c in causal)


def accurate(device, family: str = "lln") -> bool:
    """Whether the settings in force pass ``family``'s ``check`` in fp16 and bf16."""
    return all(r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"]
               for dtype in (torch.float16, torch.bfloat16) for r in check(dtype, device, family))


def search(dtype, device, repeats: int, kernels=None, on_best=None) -> Tuple[Dict[str, dict], List[dict]]:
    """Greedy: each kernel's candidates (``kernels``: some) with the others at their best so far ({kernel: settings},
    as ``LINATTN_TRITON_LAUNCH`` takes it), a candidate that fails its family's ``check`` left out; then
    ``lln_noncausal.SPLIT_ROWS`` (left at its best). ``on_best(best, rows)`` after each kernel: a run stopped by its
    time limit keeps what it found."""
    best: Dict[str, dict] = {}
    rows = []
    for kernel, candidates in CANDIDATES.items():
        if kernels and kernel not in kernels:
            continue
        results = []
        for settings in [dict(common.LAUNCH[kernel])] + candidates:
            os.environ["LINATTN_TRITON_LAUNCH"] = json.dumps({**best, kernel: settings})
            try:
                if not accurate(device, fused_ops.family_of(kernel)):
                    print(f"{kernel} {settings}: outside the tolerances, left out", flush=True)
                    rows.append({"kernel": kernel, "settings": settings, "ms": None, "accurate": False})
                    continue
                seconds = kernel_seconds(kernel, dtype, device, repeats)
            except Exception as exc:  # a setting the compiler or the GPU refuses (registers, shared memory)
                print(f"{kernel} {settings}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            results.append((seconds, settings))
            rows.append({"kernel": kernel, "settings": settings, "ms": seconds * 1e3, "accurate": True})
            print(f"{kernel:26s} {json.dumps(settings):55s} {seconds * 1e3:8.3f} ms", flush=True)
        if results:
            best[kernel] = min(results, key=lambda r: r[0])[1]
            if on_best:
                on_best(best, rows)
    os.environ["LINATTN_TRITON_LAUNCH"] = json.dumps(best)
    if kernels and "SPLIT_ROWS" not in kernels:
        return best, rows
    results = []
    for split in SPLITS:
        lln_noncausal.SPLIT_ROWS = split
        seconds = op_seconds("lln", False, dtype, device, repeats)
        results.append((seconds, split))
        rows.append({"kernel": "SPLIT_ROWS", "settings": split, "ms": seconds * 1e3})
        print(f"{'SPLIT_ROWS':26s} {split:<55d} {seconds * 1e3:8.3f} ms", flush=True)
    lln_noncausal.SPLIT_ROWS = min(results)[1]
    return best, rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-only", action="store_true", help="the reference check, no search")
    p.add_argument("--kernels", nargs="+", default=None, choices=list(CANDIDATES) + ["SPLIT_ROWS"],
                   help="search only these (default: every kernel of --families, then SPLIT_ROWS)")
    p.add_argument("--families", nargs="+", default=list(fused_ops.FAMILIES), choices=list(fused_ops.FAMILIES),
                   help="check these families' ops and search their kernels (default: all)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--env", type=Path, default=None, help="write LINATTN_TRITON_LAUNCH='<best>' here (sh syntax)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available():
        print("tune_fused: needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    checks = [r for family in args.families for half in (torch.float16, torch.bfloat16)
              for r in check(half, device, family)]
    for r in checks:
        ok = r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"]
        print(f"check {r['family']} {r['dtype']} {'causal' if r['causal'] else 'non-causal'}: out {r['out']:.2e} "
              f"(<= {r['tolerance']:.0e}), grads {r['grads']:.2e} (<= {r['grad_tolerance']:.0e}) "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
    res = {"machine": measure.machine_info(device), "dtype": args.dtype, "shapes": SHAPES, "checks": checks}
    if args.json:  # now and after each kernel: a run stopped by its time limit keeps its checks and what it timed
        write_json(args.json, res)
    if not args.check_only:
        def keep(best, rows):
            if args.env:
                args.env.parent.mkdir(parents=True, exist_ok=True)
                args.env.write_text(f"LINATTN_TRITON_LAUNCH='{json.dumps(best)}'\n")
            if args.json:
                write_json(args.json, {**res, "best": best, "rows": rows, "partial": True})

        kernels = args.kernels or [k for k in CANDIDATES if fused_ops.family_of(k) in args.families] + (
            ["SPLIT_ROWS"] if "lln" in args.families else [])
        res["best"], res["rows"] = search(dtype, device, args.repeats, kernels, on_best=keep)
        res["split_rows"] = lln_noncausal.SPLIT_ROWS
        print("best:", json.dumps(res["best"]), "SPLIT_ROWS", res["split_rows"])
    if args.json:
        write_json(args.json, res)
    return 0 if all(r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

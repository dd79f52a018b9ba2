"""Launch settings of LLN's fused kernels on this GPU: a check against the float64 reference, then a greedy search
(one kernel at a time, the others at their best so far) over warps, pipeline stages and block sizes, timing the
op's forward + backward (CUDA events, median) at the training shapes (docs/design.md §1.3.1).

    python -m linattn_tools.benchmark.tune_fused --json runs/tune_fused.json --env runs/tune_fused.env
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

from linattn import ops
from linattn.ops.triton import common, lln_noncausal
from linattn.tolerances import tolerance

from . import measure
from .cli import write_json

# (B, N) at 32K tokens a step, H = 12, D = Dv = 64 (the targets' shapes, docs/design.md §1.3)
SHAPES = ((8, 4096), (1, 32768))
TF32 = dict(TF32=True)  # the unbounded operands' products on tensor cores (kept only where the check passes)
CANDIDATES = {  # per kernel: the settings tried besides LAUNCH's own
    "lln_key_max": [dict(num_warps=w) for w in (2, 8)],
    "lln_causal_states": [dict(BF=f, num_warps=w, num_stages=2) for f in (16, 32) for w in (2, 4)]
    + [dict(BV=32), dict(BV=32, num_warps=2)],
    "lln_causal_outputs": [dict(num_warps=8), TF32, dict(num_warps=8, **TF32)],
    "lln_causal_grad_states": [dict(BF=32, num_warps=4), dict(BV=32), TF32, dict(BF=32, num_warps=4, **TF32)],
    "lln_causal_grads": [dict(num_warps=4), dict(num_warps=8, num_stages=2), TF32, dict(num_warps=4, **TF32)],
    "lln_noncausal_state": [dict(num_warps=8), dict(num_stages=3)],
    "lln_noncausal_readout": [dict(num_warps=8), TF32],
    "lln_noncausal_state_grad": [dict(num_warps=4), TF32, dict(num_stages=3, **TF32)],
    "lln_noncausal_rows_grad": [dict(num_warps=4), TF32, dict(num_warps=4, **TF32)],
}
CHECK_N = 1000  # the length of ``check``: odd chunks (C = 64), several non-causal splits of 64 rows
SPLITS = (512, 1024, 2048)  # lln_noncausal.SPLIT_ROWS: rows a program of the non-causal reductions sums


def inputs(b: int, n: int, dtype, device, heads: int = 12, d: int = 64, seed: int = 0):
    gen = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(b, heads, n, d, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in "qkv")
    grad = torch.randn(b, heads, n, d, generator=gen, device=device, dtype=dtype)
    alpha = torch.linspace(0.8, 1.2, heads, device=device).view(1, heads, 1, 1)  # per head, != beta
    return q, k, v, grad, alpha, 0.9


def call(q, k, v, alpha, beta, causal: bool, mask=None, impl: str = "fused"):
    return ops.lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=mask, chunk_size=64, impl=impl)


def check(dtype, device) -> List[dict]:
    """Forward and input gradients against the float64 reference at N = CHECK_N (the second sequence's last eighth
    padded), both causalities: relative errors and the tolerance of ``linattn/tolerances.py``."""
    rows = []
    q, k, v, grad, alpha, beta = inputs(2, CHECK_N, dtype, device, heads=4)
    mask = torch.zeros(2, CHECK_N, dtype=torch.bool, device=device)
    mask[1, CHECK_N - CHECK_N // 8:] = True
    for causal in (False, True):
        m = None if causal else mask
        out = call(q, k, v, alpha, beta, causal, m)
        got = torch.autograd.grad(out, (q, k, v), grad)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = ops.lln_attention_reference(*leaves, alpha.double(), beta, causal=causal, key_padding_mask=m)
        want = torch.autograd.grad(ref, leaves, grad.double())
        err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
        rows.append({"causal": causal, "dtype": str(dtype).split(".")[-1], "out": err(out, ref),
                     "grads": max(err(a, b) for a, b in zip(got, want)),
                     "tolerance": tolerance("lln", str(dtype).split(".")[-1]),
                     "grad_tolerance": tolerance("lln", str(dtype).split(".")[-1], gradient=True)})
    return rows


def op_seconds(causal: bool, dtype, device, repeats: int) -> float:
    """Sum over SHAPES of the op's forward + backward median time (non-causal: the last eighth padded)."""
    total = 0.0
    for b, n in SHAPES:
        q, k, v, grad, alpha, beta = inputs(b, n, dtype, device)
        mask = None
        if not causal:
            mask = torch.zeros(b, n, dtype=torch.bool, device=device)
            mask[-1, n - n // 8:] = True
        run = lambda: torch.autograd.grad(call(q, k, v, alpha, beta, causal, mask), (q, k, v), grad)  # noqa: E731
        for _ in range(2):
            run()
        total += statistics.median(measure.elapsed_seconds(run, device) for _ in range(repeats))
    return total


def accurate(device) -> bool:
    """Whether the settings in force pass ``check`` in fp16 and bf16."""
    return all(r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"]
               for dtype in (torch.float16, torch.bfloat16) for r in check(dtype, device))


def search(dtype, device, repeats: int, kernels=None, on_best=None) -> Tuple[Dict[str, dict], List[dict]]:
    """Greedy: each kernel's candidates (``kernels``: some) with the others at their best so far ({kernel: settings},
    as ``LINATTN_TRITON_LAUNCH`` takes it), a candidate that fails ``check`` left out; then
    ``lln_noncausal.SPLIT_ROWS`` (left at its best). ``on_best(best)`` after each kernel: a run stopped by its time
    limit keeps what it found."""
    best: Dict[str, dict] = {}
    rows = []
    for kernel, candidates in CANDIDATES.items():
        if kernels and kernel not in kernels:
            continue
        causal = "noncausal" not in kernel
        results = []
        for settings in [dict(common.LAUNCH[kernel])] + candidates:
            os.environ["LINATTN_TRITON_LAUNCH"] = json.dumps({**best, kernel: settings})
            try:
                if not accurate(device):
                    print(f"{kernel} {settings}: outside the tolerances, left out", flush=True)
                    rows.append({"kernel": kernel, "settings": settings, "ms": None, "accurate": False})
                    continue
                seconds = op_seconds(causal, dtype, device, repeats)
            except Exception as exc:  # a setting the compiler refuses (registers, shared memory)
                print(f"{kernel} {settings}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            results.append((seconds, settings))
            rows.append({"kernel": kernel, "settings": settings, "ms": seconds * 1e3, "accurate": True})
            print(f"{kernel:26s} {json.dumps(settings):55s} {seconds * 1e3:8.3f} ms", flush=True)
        if results:
            best[kernel] = min(results, key=lambda r: r[0])[1]
            if on_best:
                on_best(best)
    os.environ["LINATTN_TRITON_LAUNCH"] = json.dumps(best)
    if kernels and "SPLIT_ROWS" not in kernels:
        return best, rows
    results = []
    for split in SPLITS:
        lln_noncausal.SPLIT_ROWS = split
        seconds = op_seconds(False, dtype, device, repeats)
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
                   help="search only these (default: every kernel, then SPLIT_ROWS)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--env", type=Path, default=None, help="write LINATTN_TRITON_LAUNCH='<best>' here (sh syntax)")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available():
        print("tune_fused: needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    checks = check(torch.float16, device) + check(torch.bfloat16, device)
    for r in checks:
        ok = r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"]
        print(f"check {r['dtype']} {'causal' if r['causal'] else 'non-causal'}: out {r['out']:.2e} "
              f"(<= {r['tolerance']:.0e}), grads {r['grads']:.2e} (<= {r['grad_tolerance']:.0e}) "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
    res = {"machine": measure.machine_info(device), "dtype": args.dtype, "shapes": SHAPES, "checks": checks}
    if not args.check_only:
        def keep(best):
            if args.env:
                args.env.parent.mkdir(parents=True, exist_ok=True)
                args.env.write_text(f"LINATTN_TRITON_LAUNCH='{json.dumps(best)}'\n")

        res["best"], res["rows"] = search(dtype, device, args.repeats, args.kernels, on_best=keep)
        res["split_rows"] = lln_noncausal.SPLIT_ROWS
        print("best:", json.dumps(res["best"]), "SPLIT_ROWS", res["split_rows"])
    if args.json:
        write_json(args.json, res)
    return 0 if all(r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The GPU shape of one module training step, measured on any device: launched ATen ops and host syncs per
step at two lengths (the op budget compares them), bytes saved for backward in bf16 against softmax's.

    python -m dev.perf.gpu_shape [--impl parallel] [--lengths 2048 8192] [--json F]
    python -m dev.perf.gpu_shape --render BEFORE.json PARALLEL.json LOOPED.json --docs docs/benchmarks.md

One step (``linattn_tools.benchmark.module_step``): ``build_attention(method, 768, 12)``, B = 2 with the second
sequence's last eighth padded, forward + backward from an output gradient, default options (docs/benchmarks.md, "GPU
shape").
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from linattn.methods import methods_for
from linattn_tools.benchmark.cli import write_json
from linattn_tools.benchmark.dispatch import count_dispatch
from linattn_tools.benchmark.module_step import build, module_step_inputs, step
from linattn_tools.benchmark.report import write_section
from linattn_tools.methods_extra import METHODS_EXTRA

from .saved import saved_bytes

ROLES = {"encoder": False, "decoder": True}


def count_step(method: str, causal: bool, n: int, impl: str, device: str = "cpu", **options) -> Dict[str, int]:
    """Launched ATen ops and host syncs of one training step on ``device`` (``meta``: the same ops as a real device
    but SDPA's, which the meta device decomposes, with no arithmetic)."""
    module = build(method, causal, impl, device=device, **options)
    x, mask = module_step_inputs(n, device=device)
    step(module, x, mask)  # warm-up: first-call work (landmark draws, lazy buffers) is not counted
    with count_dispatch() as counts:
        step(module, x, mask)
    return {"ops": counts.launched, "syncs": counts.host_syncs, "sync_ops": dict(counts.syncs)}


def bf16_saved_bytes(method: str, causal: bool, n: int, impl: str) -> int:
    module = build(method, causal, impl, dtype=torch.bfloat16)
    x, mask = module_step_inputs(n, dtype=torch.bfloat16)
    with saved_bytes() as held:
        out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
    del out
    return held["bytes"]


def measure(impl: str, lengths: List[int], saved_n: Optional[int], methods: Optional[List[str]] = None) -> dict:
    rows = []
    for role, causal in ROLES.items():
        for method in methods_for(role):
            if methods and method not in methods:
                continue
            row = {"method": method, "role": role, "counts": {}}
            for n in lengths:
                row["counts"][str(n)] = count_step(method, causal, n, impl)
            if saved_n:
                row["bf16_saved_bytes"] = bf16_saved_bytes(method, causal, saved_n, impl)
            rows.append(row)
            print(_line(row, lengths), flush=True)
    return {"impl": impl, "lengths": lengths, "saved_n": saved_n, "rows": rows}


def _line(row: dict, lengths: List[int]) -> str:
    counts = " ".join(f"{row['counts'][str(n)]['ops']:>6}" for n in lengths)
    syncs = max(row["counts"][str(n)]["syncs"] for n in lengths)
    saved = row.get("bf16_saved_bytes")
    return f"{METHODS_EXTRA[row['method']].title:<24} {row['role']:<8} {counts} {syncs:>6} {saved if saved else '':>12}"


def _by_case(res: dict) -> Dict[tuple, dict]:
    return {(r["method"], r["role"]): r for r in res["rows"]}


def render(before: dict, impls: List[dict]) -> str:
    """Markdown: per method and role, ATen ops at each length and host syncs before and in each implementation, then
    bf16 bytes saved for backward over softmax's (same role)."""
    lengths = before["lengths"]
    sets = [(f"before ({before.get('revision', 'earlier')})", before)] + [(f"`{f['impl']}`", f) for f in impls]
    head = ["method", "role"] + [f"{name} ops N={n}" for name, _ in sets for n in lengths] + \
        [f"{name} syncs" for name, _ in sets] + [f"{name} bf16 saved / softmax" for name, _ in sets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cases = [_by_case(res) for _, res in sets]
    for key in cases[0]:
        cells = [METHODS_EXTRA[key[0]].title, key[1]]
        cells += [str(c[key]["counts"][str(n)]["ops"]) if key in c else "–" for c in cases for n in lengths]
        cells += [str(max(c[key]["counts"][str(n)]["syncs"] for n in lengths)) if key in c else "–" for c in cases]
        for c in cases:
            soft = c.get(("softmax", key[1]), {}).get("bf16_saved_bytes")
            mine = c.get(key, {}).get("bf16_saved_bytes")
            cells.append(f"{mine / soft:.2f}" if soft and mine else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("auto", "parallel", "looped"), default="parallel")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--saved-n", type=int, default=4096, help="N of the bf16 saved-bytes step (0: skip)")
    p.add_argument("--methods", nargs="+", default=None, help="only these methods (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                   help="measure nothing: render these results (the first is the 'before' column set)")
    p.add_argument("--docs", type=Path, default=None, help="with --render: rewrite the gpu-shape section of this file")
    args = p.parse_args(argv)
    if args.render:
        results = [json.loads(path.read_text()) for path in args.render]
        table = render(results[0], results[1:])
        print(table)
        if args.docs:
            write_section(args.docs, "gpu-shape", table)
        return 0
    print(f"{'method':<24} {'role':<8} " + " ".join(f"{n:>6}" for n in args.lengths) + "  syncs  bf16 saved")
    res = measure(args.impl, args.lengths, args.saved_n, args.methods)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

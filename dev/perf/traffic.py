"""The memory traffic of one attention module's training step, counted on the ``meta`` device (no GPU needed): the
bytes each ATen op (or custom op) reads and writes, and a floor on its GPU time, max(bytes / bandwidth, matmul
FLOPs / rate) + a launch, summed per op name. A lower bound that says which ops move the bytes; the profiler on a
GPU (``profile_step``) says what they cost. SDPA on ``meta`` is its materialising (math) form, so the softmax
module's count is not its flash kernel's.

    python -m dev.perf.traffic --method lln --causal --n 4096 --impl fused
    python -m dev.perf.traffic --floors docs/benchmarks/step_floors.json    # every target series at every N

``--floors``: the floor of every fused series of the targets (``linattn_tools.benchmark.targets``) at each of their
N, which ``targets --render --floors`` sets beside each fused step's time.
"""
import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from linattn_tools.benchmark.cli import write_json
from linattn_tools.benchmark.module_step import add_step_arguments, build, module_step_inputs, step
from linattn_tools.benchmark.targets import SIZES, TARGETS

BANDWIDTH = 2.5e12  # bytes/s an H100's HBM3 sustains in practice (3.35 nominal)
HALF_RATE, FLOAT_RATE = 600e12, 50e12  # dense matmul FLOP/s in half precision (tensor cores) and fp32
LAUNCH = 3e-6  # seconds a kernel launch adds at least


class _Traffic(TorchDispatchMode):
    """Per non-view op: name, bytes of its tensor inputs and outputs, matmul FLOPs, output dtype."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view moves no byte
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        flops = 0
        if name in ("mm", "addmm"):
            flops = 2 * ins[-2].shape[0] * ins[-2].shape[1] * ins[-1].shape[1]
        elif name in ("bmm", "baddbmm"):
            flops = 2 * ins[-2].shape[0] * ins[-2].shape[1] * ins[-2].shape[2] * ins[-1].shape[2]
        elif name in INVERSE_PRODUCTS:  # Skyformer's M^-1 kernels: their d×d×d products and kernel rows' d×d×D
            b, h, d, dim = ins[0].shape
            cubes, rows = INVERSE_PRODUCTS[name]
            flops = 2 * b * h * (cubes * d ** 3 + rows * d * d * dim)
        self.rows.append((name, _moved(name, args, ins, outs), flops, outs[0].dtype if outs else None))
        return out


# (d×d×d products, d×d×D products) a head of ``triton/nystrom_inverse.py``'s ops, 6 steps: 4 a step forward and the
# normalisation's two passes of kernel rows; 11 a step backward, kernel rows three times and dL/dL once. Their bytes
# here are their tensors' (the work area they pass through is L1's and L2's, as far as it fits: a floor)
INVERSE_PRODUCTS = {"nystrom_inverse": (24, 2), "nystrom_inverse_backward": (66, 4)}
GATHERS = ("gather", "index_select")  # (input, dim, index): reads as many of input's elements as they write
SCATTERS = ("scatter_add_", "scatter_", "index_add_", "index_copy_")  # (self, dim, index, src or a scalar)


def _moved(name: str, args, ins: List[torch.Tensor], outs: List[torch.Tensor]) -> int:
    """Bytes an op reads and writes: its tensor inputs' and outputs' (``_bytes``), but a gather reads only as many of
    its input's elements as it writes, and an in-place scatter reads and writes only the target's elements its index
    addresses (index_add: its source's rows), besides the index and source."""
    if name in GATHERS:
        return _bytes(args[2]) + 2 * sum(_bytes(t) for t in outs)
    if name in SCATTERS:  # scatter: an element of self per element of the index; index_add: a row per row of src
        index, src = args[2], args[3]
        touched = (src if name.startswith("index_") else index).numel() * args[0].element_size()
        return _bytes(index) + (_bytes(src) if isinstance(src, torch.Tensor) else 0) + 2 * touched
    return sum(_bytes(t) for t in ins + outs)


def _bytes(t: torch.Tensor) -> int:
    """The bytes of the elements t addresses: an expanded tensor (stride 0, as a gather's index along one dim) reads
    each of its elements once from memory, its repeats from cache."""
    return math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()


def seconds(nbytes: int, flops: int, dtype) -> float:
    """The floor on one op's GPU time: memory or matmul bound, plus a launch."""
    rate = HALF_RATE if dtype in (torch.float16, torch.bfloat16) else FLOAT_RATE
    return max(nbytes / BANDWIDTH, flops / rate) + LAUNCH


def step_traffic(method: str, causal: bool, n: int, tokens: int, dtype: str, impl: str) -> Dict[str, object]:
    """Ops, bytes and the time floor of one training step (after one uncounted step), and the floor per op name."""
    dt = getattr(torch, dtype)
    module = build(method, causal, impl, dtype=dt, device="meta")
    x, mask = module_step_inputs(n, dtype=dt, device="meta", batch=max(1, tokens // n))
    mask = None if causal else mask
    step(module, x, mask)
    counter = _Traffic()
    with counter:
        step(module, x, mask)
    per_op: Dict[str, float] = defaultdict(float)
    for name, nbytes, flops, out_dtype in counter.rows:
        per_op[name] += seconds(nbytes, flops, out_dtype)
    return {"ops": len(counter.rows), "bytes": sum(r[1] for r in counter.rows), "seconds": sum(per_op.values()),
            "per_op": dict(sorted(per_op.items(), key=lambda kv: -kv[1]))}


def step_floors(sizes=SIZES, tokens: int = 32768, dtype: str = "float16") -> dict:
    """The byte and FLOP floor of every fused series of ``TARGETS`` at each N of ``sizes``: {series: {N: seconds}}
    (the bytes of bf16 are those of fp16)."""
    floors = {f"{m}{' causal' if c else ''}": {str(n): step_traffic(m, c, n, tokens, dtype, "fused")["seconds"]
                                               for n in sizes} for m, c in TARGETS}
    return {"tokens_per_step": tokens, "dtype": dtype, "impl": "fused", "floors": floors}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p, impl="parallel")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--floors", type=Path, default=None, metavar="JSON",
                   help="count no single step: write the floors of every fused target series at every N of the "
                        "targets (at --tokens-per-step) here (docs/benchmarks/step_floors.json)")
    args = p.parse_args(argv)
    if args.floors:
        write_json(args.floors, step_floors(tokens=args.tokens_per_step))
        return 0
    res = step_traffic(args.method, args.causal, args.n, args.tokens_per_step, args.dtype, args.impl)
    series = f"{args.method}{' causal' if args.causal else ''} N={args.n} {args.dtype} impl {args.impl}"
    print(f"{series}: {res['ops']} ops, {res['bytes'] / 2**30:.2f} GiB moved, floor {res['seconds'] * 1e3:.2f} ms at "
          f"{BANDWIDTH / 1e12:g} TB/s")
    for name, sec in list(res["per_op"].items())[:args.rows]:
        print(f"  {name:36s} {sec * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

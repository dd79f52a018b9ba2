"""Run every attention op against softmax on random inputs; print error, time and memory class.

Usage: python scripts/demo_attention.py [--n 2048] [--heads 4] [--head-dim 64]
"""
import argparse
import time

import torch

from fairseq_linattn import ops


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2048, help="sequence length")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    b, h, n, d = 1, args.heads, args.n, args.head_dim
    # q, k with the spread of trained models' projections (std 1 per channel)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    scale = d ** -0.25  # softmax's 1/sqrt(D) split between q and k, as the moment matching assumes
    methods = {
        "lln": lambda c: ops.lln_attention(q * scale, k * scale, v, 1.0, 1.0, causal=c),
        "lln_diag": lambda c: ops.lln_diag_attention(q * scale, k * scale, v, 1.0, 1.0, causal=c),
    }
    for name, extra in (("kernelized_attention", {}), ("skyformer_attention", {"training": False})):
        if hasattr(ops, name):
            methods[name.replace("_attention", "")] = (lambda f, kw: lambda c: None if c else f(q, k, v, **kw))(
                getattr(ops, name), extra)
    print(f"B={b} H={h} N={n} D={d}, fp32, {torch.get_num_threads()} threads")
    print(f"{'method':<12} {'causal':<7} {'time (s)':>9} {'softmax (s)':>11} {'rel. diff to softmax':>21}")
    for causal in (False, True):
        ref, t_ref = timed(lambda: ops.softmax_attention(q, k, v, causal=causal))
        for name, fn in methods.items():
            out, t = timed(lambda: fn(causal))
            if out is None:
                continue
            diff = ((out - ref).norm() / ref.norm()).item()
            print(f"{name:<12} {str(causal):<7} {t:>9.3f} {t_ref:>11.3f} {diff:>21.3f}")
    print("(a linear attention approximates softmax: the difference is its bias, not an error)")


if __name__ == "__main__":
    main()

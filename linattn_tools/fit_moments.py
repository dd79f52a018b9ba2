"""``python -m linattn_tools.fit_moments``: fit LLN's moment-matching constants a, b (LLN Appendix A.7).

    python -m linattn_tools.fit_moments --head-dim 64 --seq-len 512 --range 1 4 --out constants.json

writes the JSON that ``--lln-moment-matching fit --lln-constants-file`` reads (docs/design.md §3.1).
"""
import argparse
import json

from linattn.ops.moment_matching import fit_moment_constants


def main(argv=None) -> None:
    """Write fitted a, b (LLN Appendix A.7) to a JSON for --lln-constants-file, and print them."""
    fit = argparse.ArgumentParser(prog="python -m linattn_tools.fit_moments",
                                  description="fit a, b of var(log P_LLN) = a (sigma_q~² + sigma_k~²) + b "
                                              "(LLN A.7; docs/design.md §3.1)")
    fit.add_argument("--head-dim", type=int, required=True, help="attention head dim D")
    fit.add_argument("--seq-len", type=int, default=512, help="sequence length N (default 512)")
    fit.add_argument("--range", type=float, nargs=2, default=(1.0, 4.0), metavar=("LOW", "HIGH"),
                     help="per-side input variance range sigma~² (default: the paper's 1 4)")
    fit.add_argument("--num-points", type=int, default=16, help="variances sampled in the range (default 16)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", required=True, help="output JSON path")
    args = fit.parse_args(argv)
    a, b = fit_moment_constants(args.head_dim, args.seq_len, tuple(args.range), args.num_points, args.seed)
    result = {"a": a, "b": b, "head_dim": args.head_dim, "seq_len": args.seq_len, "range": list(args.range)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

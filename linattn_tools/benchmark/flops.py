"""Matmul FLOPs of each attention for one forward on (B, H, N, D) inputs, counted from the algorithm.

A multiply-add is 2 FLOPs; only matrix products are counted (exp, softmax, masks are left out, so
time / (FLOPs / matmul rate) is a lower bound's ratio: the "FLOP floor" of the benchmark tables). A backward
costs two matmuls per forward matmul, so a training step (forward + backward) is 3× the forward.
The per-method counts are declared with each method (``linattn.methods``, ``Method.flops``; block softmax's
in ``linattn_tools.methods_extra.BENCHMARK_EXTRAS``).
"""
from typing import Dict

from linattn.config import AttentionConfig
from linattn_tools.methods_extra import benchmarked


def forward_flops(method: str, n: int, d: int, *, causal: bool, opts: Dict[str, int]) -> float:
    """Matmul FLOPs of one forward for one (batch, head) (``linattn.methods``' counts, block softmax's among
    ``BENCHMARK_EXTRAS``); ``opts`` as in the benchmark's method table (chunk_size, block_size, window, bases,
    landmarks)."""
    counted = benchmarked()
    if method not in counted:
        raise ValueError(f"no FLOP count for method {method!r}")
    cfg = AttentionConfig(lln_chunk_size=opts["chunk_size"], lln_diag_block_size=opts["block_size"],
                          lavo_window=opts["window"], lavo_bases=opts["bases"], skyformer_landmarks=opts["landmarks"])
    return counted[method].flops(n, d, causal, cfg)


def training_flops(method: str, n: int, batch: int, heads: int, d: int, *, causal: bool,
                   opts: Dict[str, int]) -> float:
    """Forward + backward matmul FLOPs over all batch elements and heads (3× the forward)."""
    return 3 * batch * heads * forward_flops(method, n, d, causal=causal, opts=opts)

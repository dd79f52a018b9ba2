"""Matmul FLOPs of each attention for one forward on (B, H, N, D) inputs, counted from the algorithm.

A multiply-add is 2 FLOPs; only matrix products are counted (exp, softmax, masks are left out, so
time / (FLOPs / matmul rate) is a lower bound's ratio: the "FLOP floor" of the issue). A backward
costs two matmuls per forward matmul, so a training step (forward + backward) is 3× the forward.
Per (batch, head):
- softmax, kernelized: Q K^T and P V, 4 N² D (causal softmax: the lower triangle, 2 N² D)
- LLN non-causal: S = phi_k^T [V, 1] and phi_q S, 4 N D (D+1) (LLN eq. 8-9)
- LLN causal, chunks of C: per chunk phi_q phi_k^T and W [V, 1] (2 C² (2D+1)), the chunk's state
  and the queries against the state before it (4 C D (D+1))
- block softmax, blocks of bs: 4 N bs D (full blocks, causal ones included); LLN+Diag = LLN + it
- LAVO, window w, r bases: local 4 N w D (non-causal) or 8 N w D (causal: own and previous
  window), global x B^T, q B^T and the read-out 6 N r D
- Skyformer, d landmarks: C_Q, C_K, C_K^T V, C_Q (.) 8 N d D; M and M^-1 V-side products 4 d² D;
  6 Newton–Schulz steps of 4 d×d products 48 d³
"""
from typing import Dict


def _lln(n: int, d: int, causal: bool, chunk: int) -> float:
    if not causal:
        return 4 * n * d * (d + 1)
    c = min(chunk, n)
    chunks = -(-n // c)
    return chunks * (2 * c * c * (2 * d + 1) + 4 * c * d * (d + 1))


def _block(n: int, d: int, block: int) -> float:
    bs = min(block, n)
    return 4 * (-(-n // bs)) * bs * bs * d


def forward_flops(method: str, n: int, d: int, *, causal: bool, opts: Dict[str, int]) -> float:
    """Matmul FLOPs of one forward for one (batch, head); ``opts`` as in the benchmark's method table."""
    if method == "softmax":
        return (2 if causal else 4) * n * n * d
    if method == "kernelized":
        return 4 * n * n * d
    if method == "lln":
        return _lln(n, d, causal, opts["chunk_size"])
    if method == "block_softmax":
        return _block(n, d, opts["block_size"])
    if method == "lln_diag":
        return _lln(n, d, causal, opts["chunk_size"]) + _block(n, d, opts["block_size"])
    if method == "lavo":
        w, r = opts["window"], opts["bases"]
        nw = -(-n // w) * w  # padded to whole windows
        return (8 if causal else 4) * nw * w * d + 6 * nw * r * d
    if method == "skyformer":
        m = min(opts["landmarks"], 2 * n)
        return 8 * n * m * d + 4 * m * m * d + 48 * m ** 3
    raise ValueError(f"no FLOP count for method {method!r}")


def training_flops(method: str, n: int, batch: int, heads: int, d: int, *, causal: bool,
                   opts: Dict[str, int]) -> float:
    """Forward + backward matmul FLOPs over all batch elements and heads (3× the forward)."""
    return 3 * batch * heads * forward_flops(method, n, d, causal=causal, opts=opts)

"""Skyformer Fig. 1 (§4.5): approximation error of the Nyström form against the number of landmarks.

The paper measures the spectral norm of the difference between an approximate attention output and
the exact one, for 2^4 ... 2^8 features and several sequence lengths, on BERT's q, k, v of WikiText-2
text. Here the exact output is our kernelized attention (``ops.kernelized_attention``, the target
Skyformer approximates) and the approximation ``ops.skyformer_attention`` (uniformly drawn landmarks,
as in training); the error of one head is ||Y_sky - Y_exact||_2 / ||Y_exact||_2 over its N x Dv
output, averaged over heads and draws. No BERT weights here: two input families stand in for the
paper's initialised and pretrained projections,

- ``gaussian``: q, k, v with i.i.d. N(0, 1) entries;
- ``low_rank``: q, k from a rank-4 latent (entries of variance 1) plus N(0, 0.1²) noise, v Gaussian
  (attention whose scores vary along a few directions, as trained heads' tend to).
"""
import math
from typing import Dict, Sequence

import torch

from linattn.ops import kernelized_attention, skyformer_attention

from .common import settings, torch_threads

INPUTS = ("gaussian", "low_rank")
DEFAULTS, QUICK = settings("skyformer_error")


def _qkv(kind: str, n: int, heads: int, head_dim: int, gen: torch.Generator):
    shape = (1, heads, n, head_dim)
    v = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if kind == "gaussian":
        return torch.randn(*shape, generator=gen, dtype=torch.float64), torch.randn(*shape, generator=gen,
                                                                                   dtype=torch.float64), v
    rank = 4
    basis = torch.randn(heads, rank, head_dim, generator=gen, dtype=torch.float64) / math.sqrt(rank)
    q, k = (torch.randn(1, heads, n, rank, generator=gen, dtype=torch.float64) @ basis
            + 0.1 * torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def relative_spectral_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact||_2 / ||exact||_2 per leading index of (..., N, Dv) outputs."""
    return torch.linalg.matrix_norm(approx - exact, ord=2) / torch.linalg.matrix_norm(exact, ord=2)


def measure(*, seq_lens: Sequence[int], landmarks: Sequence[int], head_dim: int, heads: int, draws: int,
            seed: int, threads: int) -> Dict:
    """{"errors": {input: {N: {landmarks: mean relative spectral error}}}}."""
    with torch_threads(threads):
        return _measure(seq_lens, landmarks, head_dim, heads, draws, seed)


@torch.no_grad()
def _measure(seq_lens, landmarks, head_dim, heads, draws, seed) -> Dict:
    gen = torch.Generator().manual_seed(seed)
    errors: Dict[str, Dict[str, Dict[str, float]]] = {}
    for kind in INPUTS:
        errors[kind] = {}
        for n in seq_lens:
            sums = {d: 0.0 for d in landmarks}
            for _ in range(draws):
                q, k, v = _qkv(kind, n, heads, head_dim, gen)
                exact = kernelized_attention(q, k, v)
                for d in landmarks:
                    approx = skyformer_attention(q, k, v, num_landmarks=d, training=True, generator=gen)
                    sums[d] += relative_spectral_error(approx, exact).mean().item() / draws
            errors[kind][str(n)] = {str(d): e for d, e in sums.items()}
            print(f"[skyformer_error] {kind} N={n}: " + ", ".join(f"d={d}: {e:.3f}" for d, e in sums.items()),
                  flush=True)
    return {"errors": errors}

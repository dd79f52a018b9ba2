"""Concentration of softmax and LLN attention on Gaussian q, k, from first principles (LLN §3-4).

q, k have i.i.d. N(0, sigma²) entries ("input variance" sigma² per side), so softmax scores q·k/sqrt(D)
have variance sigma⁴ and ln P_softmax is about N(-ln N - sigma⁴/2, sigma⁴) (Prop. 3.1). LLN is
measured unmatched (alpha = beta = 1, whose var(log P) grows like a(2 sigma²) + b, Prop. 4.1) and
moment-matched (alpha, beta from sigma by the paper's constants and by the ``exact`` table, docs/design.md §3.1),
which should follow softmax. Every variance reuses the same normal draws, so the curves are smooth.
"""
import math
from typing import Dict, List, Sequence

import torch

from ..ops import lln_attention_weights, softmax_attention_weights
from ..ops.moment_matching import exact_moment_table, lln_alpha_beta
from .concentration import entropy, log_moments, sparsity, spectral_gap

METHODS = ("softmax", "lln_unmatched", "lln_paper", "lln_exact")
DEFAULT_VARIANCES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)


def _matrices(q, k, sigma: float, head_dim: int, seq_len: int):
    """The N x N matrix of each of ``METHODS`` on q, k: softmax and LLN with alpha, beta as labelled."""
    settings = {"lln_unmatched": (1.0, 1.0), "lln_paper": lln_alpha_beta(sigma, sigma),
                "lln_exact": exact_moment_table(head_dim, seq_len).alpha_beta(sigma, sigma)}
    return {"softmax": softmax_attention_weights(q, k),
            **{name: lln_attention_weights(q, k, alpha, beta) for name, (alpha, beta) in settings.items()}}


@torch.no_grad()
def synthetic_curves(*, head_dim: int = 64, seq_len: int = 256, variances: Sequence[float] = DEFAULT_VARIANCES,
                     num_matrices: int = 4, histogram_variance: float = 1.0, histogram_samples: int = 20000,
                     seed: int = 0) -> Dict:
    """Measures of each method at each input variance, and ln P samples at ``histogram_variance``.

    Returns a JSON-ready dict: ``points`` (one per variance: ``input_variance``, the softmax theory
    ``theory_log_p_var`` = sigma⁴ and ``theory_log_p_mean`` = -ln N - sigma⁴/2, and per method the means over
    ``num_matrices`` N x N matrices of entropy, spectral_gap, sparsity, log_p_mean, log_p_var) and
    ``log_p_samples`` (per method, ``histogram_samples`` values of ln P at ``histogram_variance``).
    """
    for name, value in (("head_dim", head_dim), ("seq_len", seq_len), ("num_matrices", num_matrices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "seq_len" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {2 if name == 'seq_len' else 1}, "
                             f"got {value!r}")
    variances = sorted({float(v) for v in list(variances) + [histogram_variance]})
    if not all(v > 0 and math.isfinite(v) for v in variances):
        raise ValueError(f"--variances must be finite and > 0, got {variances}")
    gen = torch.Generator().manual_seed(seed)
    zq = torch.randn(num_matrices, 1, seq_len, head_dim, generator=gen, dtype=torch.float64)
    zk = torch.randn(num_matrices, 1, seq_len, head_dim, generator=gen, dtype=torch.float64)
    points: List[Dict] = []
    samples: Dict[str, List[float]] = {}
    for variance in variances:
        sigma = math.sqrt(variance)
        point = {"input_variance": variance, "theory_log_p_var": variance ** 2,
                 "theory_log_p_mean": -math.log(seq_len) - variance ** 2 / 2}
        for method, P in _matrices(sigma * zq, sigma * zk, sigma, head_dim, seq_len).items():
            mean, var = log_moments(P)
            point[method] = {name: value.mean().item() for name, value in (  # sync ok: analysis, not a training step
                ("entropy", entropy(P)), ("spectral_gap", spectral_gap(P)), ("sparsity", sparsity(P)),
                ("log_p_mean", mean), ("log_p_var", var))}
            if variance == float(histogram_variance):
                values = P.log().flatten()
                pick = torch.randperm(values.numel(), generator=gen)[:histogram_samples]
                samples[method] = values[pick].tolist()
        points.append(point)
    return {"mode": "synthetic", "head_dim": head_dim, "seq_len": seq_len, "num_matrices": num_matrices,
            "seed": seed, "histogram_variance": float(histogram_variance), "points": points,
            "log_p_samples": samples}

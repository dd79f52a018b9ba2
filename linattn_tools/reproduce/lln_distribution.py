"""LLN Prop. 3.1, Fig. 5 and Fig. 2 on Gaussian q, k: the distribution and concentration of P.

For each head dim D and per-side input variance sigma² (q, k with i.i.d. N(0, sigma²) entries, as
softmax receives them, so its scores q·k/sqrt(D) have variance sigma⁴), ``num_matrices`` N x N
attention matrices are formed for

- ``softmax``: Prop. 3.1 predicts ln P ~ N(-ln N - sigma⁴/2, sigma⁴);
- ``lln_unmatched``: LLN with alpha = beta = 1 (LLN Fig. 5b's "before moment matching");
- ``lln_paper``, ``lln_fit``, ``lln_exact``: LLN with alpha, beta from moment matching (eq. 10) with
  the published constants a, b; with a, b fitted by LLN Appendix A.7 for this D and N
  (``ops.moment_matching.fit_moment_constants``); and by inverting the measured variance table
  (``ops.moment_matching.exact_moment_table``).

Per matrix: mean and variance of ln P (``analysis.log_moments``), row entropy in bits and spectral
gap (``analysis.entropy``, ``analysis.spectral_gap``), averaged over the matrices. Every variance
reuses the same normal draws, so the curves are smooth in sigma².
"""
import math
from typing import Dict, Sequence

import torch

from linattn.analysis.concentration import entropy, log_moments, spectral_gap
from linattn.ops import lln_attention_weights, softmax_attention_weights
from linattn.ops.moment_matching import PAPER_A, PAPER_B, exact_moment_table, fit_moment_constants, lln_alpha_beta

from .common import settings, torch_threads

METHODS = ("softmax", "lln_unmatched", "lln_paper", "lln_fit", "lln_exact")
DEFAULTS, QUICK = settings("lln_distribution")


def _alpha_beta(method: str, sigma: float, constants: Dict[str, float], head_dim: int, seq_len: int):
    if method == "lln_unmatched":
        return 1.0, 1.0
    if method == "lln_paper":
        return lln_alpha_beta(sigma, sigma, PAPER_A, PAPER_B)
    if method == "lln_fit":
        return lln_alpha_beta(sigma, sigma, constants["a"], constants["b"])
    return exact_moment_table(head_dim, seq_len).alpha_beta(sigma, sigma)


def measure(*, head_dims: Sequence[int], seq_len: int, variances: Sequence[float], num_matrices: int,
            fit_range: Sequence[float], seed: int, threads: int) -> Dict:
    """{"per_head_dim": {D: {"fit": {a, b}, "points": [{input_variance, theory, <method>: measures}]}}}."""
    with torch_threads(threads):
        return _measure(head_dims, seq_len, variances, num_matrices, fit_range, seed)


@torch.no_grad()
def _measure(head_dims, seq_len, variances, num_matrices, fit_range, seed) -> Dict:
    out = {}
    for head_dim in head_dims:
        a, b = fit_moment_constants(head_dim, seq_len, tuple(fit_range), seed=seed)
        constants = {"a": a, "b": b}
        gen = torch.Generator().manual_seed(seed + head_dim)
        zq = torch.randn(num_matrices, 1, seq_len, head_dim, generator=gen, dtype=torch.float64)
        zk = torch.randn(num_matrices, 1, seq_len, head_dim, generator=gen, dtype=torch.float64)
        points = []
        for variance in variances:
            sigma = math.sqrt(variance)
            point = {"input_variance": variance, "softmax_temperature": 1.0 / variance,
                     "theory_log_p_var": variance ** 2, "theory_log_p_mean": -math.log(seq_len) - variance ** 2 / 2}
            for method in METHODS:
                q, k = sigma * zq, sigma * zk
                if method == "softmax":
                    P, alpha, beta = softmax_attention_weights(q, k), None, None
                else:
                    alpha, beta = _alpha_beta(method, sigma, constants, head_dim, seq_len)
                    P = lln_attention_weights(q, k, alpha, beta)
                mean, var = log_moments(P)
                point[method] = {"log_p_mean": mean.mean().item(), "log_p_var": var.mean().item(),
                                 "entropy_bits": entropy(P).mean().item(),
                                 "spectral_gap": spectral_gap(P).mean().item()}
                if alpha is not None:
                    point[method].update(alpha=float(alpha), beta=float(beta))
            points.append(point)
            print(f"[lln_distribution] D={head_dim} sigma²={variance}: var ln P softmax "
                  f"{point['softmax']['log_p_var']:.3f}, LLN paper {point['lln_paper']['log_p_var']:.3f}, "
                  f"fit {point['lln_fit']['log_p_var']:.3f}, exact {point['lln_exact']['log_p_var']:.3f}, "
                  f"unmatched {point['lln_unmatched']['log_p_var']:.3f}", flush=True)
        out[str(head_dim)] = {"fit": constants, "points": points}
    return {"per_head_dim": out, "paper_constants": {"a": PAPER_A, "b": PAPER_B}}

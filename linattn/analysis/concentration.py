"""Concentration instruments for attention matrices (docs/design.md §8; LLN §3).

Every measure takes a row-stochastic matrix P of shape (..., R, N) (R = N for a full matrix, R < N
when only sampled rows were materialised) and returns one value per leading index: a (R, N) input
gives a 0-dim tensor, a (B, H, R, N) input a (B, H) tensor. Half-precision inputs are measured in
float32; float32/float64 in their own precision; results come back in that measuring dtype.
No fairseq import: pure PyTorch.
"""
import math
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..ops import compute_dtype

F64 = torch.float64


def _check_matrix(name: str, P: Tensor, *, square: bool = False) -> Tensor:
    """Validate a floating (..., R, N) tensor; returns it in the measuring dtype."""
    if not isinstance(P, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (..., R, N), got {type(P).__name__}")
    if P.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., R, N), got shape {tuple(P.shape)}")
    if not P.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {P.dtype}")
    if square and P.shape[-1] != P.shape[-2]:
        raise ValueError(f"{name} must be square (..., N, N), got shape {tuple(P.shape)}")
    return P.to(compute_dtype(P))


def entropy(P: Tensor) -> Tensor:
    """Mean row entropy in bits, H = -(1/R) sum_ij P_ij log2 P_ij with 0 log 0 = 0.  P: (..., R, N) -> (...)."""
    P = _check_matrix("P", P)
    # LLN eq. 7
    return -torch.special.xlogy(P, P).sum(-1).mean(-1) / math.log(2.0)


def _eigenvalues(a: Tensor) -> Tensor:
    """``torch.linalg.eigvals``; where torch's LAPACK fails to converge (it does on an exactly uniform 64×64
    matrix with torch 2.13's CPU wheel), NumPy's own LAPACK build."""
    try:
        return torch.linalg.eigvals(a)
    except torch.linalg.LinAlgError:
        return torch.from_numpy(np.linalg.eigvals(a.detach().cpu().numpy())).to(a.device)


def spectral_gap(P: Tensor, *, tol: Optional[float] = None) -> Tensor:
    """1 - |lambda_2| of a row-stochastic P (LLN §3.2.2).  P: (..., N, N) with N >= 2 -> (...).

    |lambda_2| is the second-largest eigenvalue modulus, from ``torch.linalg.eigvals`` in float64.
    P must be nonnegative with rows summing to 1 within ``tol`` (default max(1e-4, eps of P's dtype)),
    otherwise ValueError.
    """
    out_dtype = _check_matrix("P", P, square=True).dtype
    if P.shape[-1] < 2:
        raise ValueError(f"P must be at least 2x2 to have a second eigenvalue, got shape {tuple(P.shape)}")
    tol = max(1e-4, torch.finfo(P.dtype).eps) if tol is None else tol
    P64 = P.to(F64)
    if bool((P64 < 0).any()):  # sync ok: analysis, not a training step
        low = P64.min().item()  # sync ok: analysis, not a training step
        raise ValueError(f"P must be row-stochastic (nonnegative entries), got min entry {low:.3g}")
    row_error = (P64.sum(-1) - 1.0).abs().max().item()  # sync ok: analysis, not a training step
    if not row_error <= tol:
        raise ValueError(f"P must be row-stochastic (rows summing to 1 within {tol:g}), "
                         f"got a row sum off by {row_error:.3g}")
    moduli = _eigenvalues(P64).abs().sort(dim=-1, descending=True).values
    return (1.0 - moduli[..., 1]).to(out_dtype)


def sparsity(P: Tensor) -> Tensor:
    """l1/l2 sparsity S = E|a| / sqrt(E a^2) per row (mean over the row's N entries, zeros included),
    averaged over rows.  P: (..., R, N) -> (...).  1 for a uniform row, 1/sqrt(N) for a one-hot row.

    For softmax with keys k ~ N(mu, s^2 I) and a scaled query q, S -> exp(-s^2 |q|^2 / 2) (Su 2023; docs/design.md §8).
    """
    P = _check_matrix("P", P)
    l1 = P.abs().mean(-1)
    l2 = P.square().mean(-1).sqrt()
    return (l1 / l2).mean(-1)


def log_moments(P: Tensor, *, relative: bool = False) -> Tuple[Tensor, Tensor]:
    """Mean and (population) variance of ln P over the positive entries of each (R, N) matrix.

    Exact zeros (causal or padding masks) are left out. For softmax attention with Gaussian scores of
    variance sigma^2, ln P is about N(-ln N - sigma^2/2, sigma^2) (LLN Prop. 3.1).
    ``relative``: measure ln(n_i P_ij) instead, n_i the number of positive entries of row i (ln P
    relative to a uniform row over the keys it sees), so that rows seeing different numbers of keys
    (causal attention) are comparable; for a matrix without zeros only the mean moves, by ln N.
    P: (..., R, N) -> (mean (...), var (...)).
    """
    P = _check_matrix("P", P)
    positive = P > 0
    count = positive.sum((-2, -1)).to(P.dtype)
    logp = torch.where(positive, P, torch.ones_like(P)).log()  # log(1) = 0 adds nothing to the sums
    if relative:
        logp = torch.where(positive, logp + positive.sum(-1, keepdim=True).to(P.dtype).log(), logp)
    mean = logp.sum((-2, -1)) / count
    centred = torch.where(positive, logp - mean[..., None, None], torch.zeros_like(P))
    return mean, centred.square().sum((-2, -1)) / count


def softmax_temperature(q: Tensor, k: Tensor) -> Tensor:
    """Temperature of softmax attention, tau_sm = 1 / sigma_sm (LLN eq. 5 and §3.2).

    sigma_sm^2 is the variance of the scaled scores q_i·k_j / sqrt(D) over the keys of a row,
    averaged over the rows: the part of the score variance that shapes P (a per-row shift cancels
    in the softmax). For q, k with i.i.d. zero-mean entries of variances sigma_q^2, sigma_k^2 it is
    sigma_q^2 sigma_k^2 (eq. 5 without C_cross), the same quantity ``lln_temperature`` describes
    for LLN, so the two temperatures compare directly. Computed from D x D second moments, O(N D^2),
    without the N x S score matrix.  q: (..., N, D), k: (..., S, D) -> (...).
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor) or t.dim() < 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of shape (..., N, D), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if q.shape[-1] != k.shape[-1] or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q (..., N, D) and k (..., S, D) must share leading dims and D, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    dtype = compute_dtype(q)
    q, k = q.to(dtype), k.to(dtype)
    D, N, S = q.shape[-1], q.shape[-2], k.shape[-2]
    kc = k - k.mean(-2, keepdim=True)
    key_cov = kc.transpose(-1, -2) @ kc / S  # Var_j(q_i·k_j) = q_i^T key_cov q_i
    query_moment = q.transpose(-1, -2) @ q / N
    sigma2 = (key_cov * query_moment).sum((-2, -1)) / D
    return sigma2.rsqrt()


def lln_temperature(alpha, beta, sigma_q, sigma_k, a, b) -> Tensor:
    """Temperature of LLN attention, tau_lln = 1/sqrt(a(alpha^2 sigma_q^2 + beta^2 sigma_k^2) + b).

    Floats or broadcastable tensors; a, b are the moment-matching constants of LLN Prop. 4.1.
    With alpha, beta from moment matching (docs/design.md §3.1) it equals 1/(sigma_q sigma_k), the Gaussian-model
    value of ``softmax_temperature``.
    """
    # LLN eq. 11
    sigma2 = a * (alpha ** 2 * sigma_q ** 2 + beta ** 2 * sigma_k ** 2) + b
    sigma2 = sigma2 if isinstance(sigma2, Tensor) else torch.tensor(sigma2, dtype=F64)
    if not bool((sigma2 > 0).all()):  # sync ok: analysis, not a training step
        raise ValueError(f"a*(alpha^2 sigma_q^2 + beta^2 sigma_k^2) + b must be > 0 for a temperature, "
                         f"got min {sigma2.min().item():.3g}")  # sync ok: analysis, not a training step
    return sigma2.rsqrt()

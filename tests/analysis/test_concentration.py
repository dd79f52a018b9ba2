"""Concentration instruments (docs/design.md §8) against closed forms and LLN's propositions."""
import math

import pytest
import torch

from linattn.analysis import (
    entropy,
    lln_temperature,
    log_moments,
    softmax_temperature,
    sparsity,
    spectral_gap,
)
from linattn.ops import softmax_attention_weights

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("N", [2, 7, 64])
def test_uniform_attention_has_max_entropy_and_unit_gap(N):
    P = torch.full((N, N), 1.0 / N, dtype=F64)
    assert entropy(P).item() == pytest.approx(math.log2(N), abs=1e-12)
    assert spectral_gap(P).item() == pytest.approx(1.0, abs=1e-9)
    assert sparsity(P).item() == pytest.approx(1.0, abs=1e-12)


def test_permutation_has_zero_entropy_and_cyclic_one_zero_gap():
    N = 9
    P = torch.eye(N, dtype=F64)[torch.randperm(N, generator=_gen(0))]
    assert entropy(P).item() == 0.0
    assert sparsity(P).item() == pytest.approx(1 / math.sqrt(N), abs=1e-12)
    cyclic = torch.eye(N, dtype=F64).roll(1, dims=1)
    assert spectral_gap(cyclic).item() == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("a, b", [(0.1, 0.2), (0.3, 0.05), (0.01, 0.6)])
def test_two_state_chain_gap_is_a_plus_b(a, b):
    # lambda_2 = 1 - a - b
    P = torch.tensor([[1 - a, a], [b, 1 - b]], dtype=F64)
    assert spectral_gap(P).item() == pytest.approx(a + b, abs=1e-12)


def test_lazy_cycle_walk_gap_matches_its_spectrum():
    # P = (1-2p) I + p (shift + shift^-1) has eigenvalues 1 - 2p + 2p cos(2 pi m / N)
    N, p = 6, 0.25
    shift = torch.eye(N, dtype=F64).roll(1, dims=1)
    P = (1 - 2 * p) * torch.eye(N, dtype=F64) + p * (shift + shift.T)
    moduli = sorted((abs(1 - 2 * p + 2 * p * math.cos(2 * math.pi * m / N)) for m in range(N)), reverse=True)
    assert spectral_gap(P).item() == pytest.approx(1 - moduli[1], abs=1e-12)  # 0.25


def test_entropy_strictly_increases_with_temperature():
    # LLN Thm. 3.2: dH/dT = Var_P(s) / T^3 > 0 for non-constant rows
    scores = torch.randn(3, 2, 33, 33, generator=_gen(1), dtype=F64) * 2
    temps = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0, 4.0, 8.0], dtype=F64)
    H = torch.stack([entropy((scores / T).softmax(-1)) for T in temps])
    assert bool((H.diff(dim=0) > 0).all())
    assert bool((H <= math.log2(33) + 1e-12).all())


def test_softmax_sparsity_matches_lognormal_limit():
    # z_j = q·k_j / sqrt(D) ~ N(q·mu / sqrt(D), s^2 |q|^2 / D); a ∝ exp(z) gives
    # E|a| / sqrt(E a^2) = E e^z / sqrt(E e^{2z}) = exp(-Var z / 2) (the mean cancels).
    D, N, reps, s = 16, 8192, 24, 1.5
    g = _gen(2)
    for var in (0.25, 1.0):
        q = torch.randn(D, generator=g, dtype=F64)
        q = q / q.norm() * math.sqrt(var * D) / s  # scaled query |q|^2 / D = var / s^2
        mu = torch.randn(D, generator=g, dtype=F64)
        k = mu + s * torch.randn(reps, 1, N, D, generator=g, dtype=F64)
        S = sparsity(softmax_attention_weights(q.expand(reps, 1, 1, D), k))
        assert S.shape == (reps, 1)
        assert S.mean().item() == pytest.approx(math.exp(-var / 2), rel=0.03)


def test_softmax_log_moments_follow_prop_3_1():
    # ln P ~ N(-ln N - sigma^2/2, sigma^2) with sigma^2 = sigma_q^2 sigma_k^2 the score variance
    N, D = 2048, 64
    g = _gen(3)
    for sigma_q, sigma_k in ((1.0, 1.0), (0.5, 2.0)):
        q = sigma_q * torch.randn(1, 1, N, D, generator=g, dtype=F64)
        k = sigma_k * torch.randn(1, 1, N, D, generator=g, dtype=F64)
        sigma2 = (sigma_q * sigma_k) ** 2
        mean, var = log_moments(softmax_attention_weights(q, k))
        assert (mean.item() + math.log(N)) == pytest.approx(-sigma2 / 2, rel=0.1)
        assert var.item() == pytest.approx(sigma2, rel=0.1)
        assert softmax_temperature(q, k).item() == pytest.approx(1 / math.sqrt(sigma2), rel=0.05)


def test_softmax_temperature_is_inverse_std_of_row_scores():
    g = _gen(4)
    q = torch.randn(2, 3, 17, 8, generator=g, dtype=F64) + 0.3
    k = 2 * torch.randn(2, 3, 29, 8, generator=g, dtype=F64) - 0.5
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    expected = scores.var(-1, unbiased=False).mean(-1).rsqrt()
    torch.testing.assert_close(softmax_temperature(q, k), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(softmax_temperature(q / 3, k), 3 * expected, rtol=1e-12, atol=0)


def test_lln_temperature_closed_form_and_moment_matching():
    assert lln_temperature(1.0, 1.0, 1.0, 1.0, 1.0, 0.0).item() == pytest.approx(1 / math.sqrt(2))
    assert lln_temperature(2.0, 0.5, 1.5, 3.0, 0.2, 0.1).item() == pytest.approx(
        1 / math.sqrt(0.2 * (4 * 2.25 + 0.25 * 9) + 0.1))
    # docs/design.md §3.1 (LLN eq. 10-11): alpha, beta from moment matching make tau_lln = 1/(sigma_q sigma_k) = tau_sm
    a, b = 0.14855178144710912, -0.35487039130661086
    sigma_q = torch.tensor([0.7, 1.0, 1.3], dtype=F64)
    sigma_k = torch.tensor([1.1, 1.0, 0.9], dtype=F64)
    s2 = ((sigma_q * sigma_k) ** 2 - b) / (2 * a)
    alpha, beta = s2.sqrt() / sigma_q, s2.sqrt() / sigma_k
    torch.testing.assert_close(lln_temperature(alpha, beta, sigma_q, sigma_k, a, b), 1 / (sigma_q * sigma_k))
    with pytest.raises(ValueError, match="must be > 0"):
        lln_temperature(0.1, 0.1, 1.0, 1.0, a, b)


def test_spectral_gap_rejects_non_row_stochastic_input():
    good = torch.full((4, 4), 0.25, dtype=F64)
    with pytest.raises(ValueError, match="rows summing to 1"):
        spectral_gap(good * 1.01)
    negative = good.clone()
    negative[0, :2] = torch.tensor([-0.25, 0.75], dtype=F64)
    with pytest.raises(ValueError, match="nonnegative"):
        spectral_gap(negative)
    with pytest.raises(ValueError, match="square"):
        spectral_gap(good[:3])
    with pytest.raises(ValueError, match="at least 2 dims"):
        entropy(good[0])


def test_measures_are_batched_per_leading_index():
    g = _gen(5)
    P = torch.randn(2, 3, 11, 11, generator=g, dtype=F64).softmax(-1)
    mean, var = log_moments(P)
    for fn_value in (entropy(P), spectral_gap(P), sparsity(P), mean, var):
        assert fn_value.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert entropy(P[i, j]).shape == ()
            torch.testing.assert_close(entropy(P[i, j]), entropy(P)[i, j])
            torch.testing.assert_close(spectral_gap(P[i, j]), spectral_gap(P)[i, j])
            torch.testing.assert_close(sparsity(P[i, j]), sparsity(P)[i, j])
            torch.testing.assert_close(log_moments(P[i, j])[1], var[i, j])
    half = spectral_gap(P.to(torch.bfloat16))
    assert half.dtype == torch.float32 and bool(torch.isfinite(half).all())


def test_relative_log_moments_put_causal_rows_on_one_scale():
    # a causal uniform matrix: row i is 1/(i+1) over i+1 keys; ln(n_i P_ij) = 0 everywhere
    N = 12
    P = torch.ones(N, N, dtype=F64).tril()
    P = P / P.sum(-1, keepdim=True)
    mean, var = log_moments(P, relative=True)
    assert mean.item() == pytest.approx(0.0, abs=1e-12) and var.item() == pytest.approx(0.0, abs=1e-12)
    assert log_moments(P)[1].item() > 0.2  # raw ln P mixes the rows' levels -ln(i+1)
    full = torch.randn(3, N, N, generator=_gen(9), dtype=F64).softmax(-1)
    raw, rel = log_moments(full), log_moments(full, relative=True)
    torch.testing.assert_close(rel[0], raw[0] + math.log(N))
    torch.testing.assert_close(rel[1], raw[1])


def test_log_moments_of_a_2x2_matrix_by_hand():
    # population moments (divide by n, not n - 1) of ln P over the positive entries
    P = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=F64)
    logs = [math.log(0.25), math.log(0.75), math.log(0.5), math.log(0.5)]
    mean = sum(logs) / 4
    var = sum((x - mean) ** 2 for x in logs) / 4
    got_mean, got_var = log_moments(P)
    assert got_mean.item() == pytest.approx(mean, rel=1e-12) and got_var.item() == pytest.approx(var, rel=1e-12)
    # a zero (masked) entry is left out: n = 3
    Z = torch.tensor([[1.0, 0.0], [0.2, 0.8]], dtype=F64)
    logs = [0.0, math.log(0.2), math.log(0.8)]
    mean = sum(logs) / 3
    got_mean, got_var = log_moments(Z)
    assert got_mean.item() == pytest.approx(mean, rel=1e-12)
    assert got_var.item() == pytest.approx(sum((x - mean) ** 2 for x in logs) / 3, rel=1e-12)
    # relative: ln(n_i P_ij) with n = (1, 2) positive entries per row
    logs = [0.0, math.log(0.4), math.log(1.6)]
    mean = sum(logs) / 3
    got_mean, got_var = log_moments(Z, relative=True)
    assert got_mean.item() == pytest.approx(mean, rel=1e-12)
    assert got_var.item() == pytest.approx(sum((x - mean) ** 2 for x in logs) / 3, rel=1e-12)

"""Kernelized attention (exact Gaussian kernel) and Skyformer (its Nyström approximation), docs/design.md §5."""
import pytest
import torch
from helpers import padding_mask, rel_err

from linattn import ops
from linattn.ops.kernelized import kernelized_kernel_matrix
from linattn.ops.kernelized.kernel import gaussian_kernel
from linattn.ops.skyformer import skyformer_kernel_matrix
from linattn.ops.skyformer.inverse import newton_schulz_inverse
from linattn.ops.skyformer.nystrom import _landmark_indices


def spectral(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x)[..., 0]


def spectral_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over (B, H) of ||approx - exact||_2 / ||exact||_2."""
    return (spectral(approx - exact) / spectral(exact)).mean().item()


def mixed_mask(n: int) -> torch.Tensor:
    """(3, n): no padding, right padding, left padding (different amounts per batch element)."""
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[1, n - n // 3:] = True
    mask[2, : n // 4] = True
    return mask


IMPLS = pytest.mark.parametrize("impl", ["parallel", "looped"])  # the ops' two implementations


def rows(x: torch.Tensor, mask: torch.Tensor, b: int) -> torch.Tensor:
    """The non-padded query rows of batch element b: (H, n_valid, ...)."""
    return x[b][:, ~mask[b]]


# ---------------------------------------------------------------- kernelized (exact)

@pytest.mark.parametrize("n", [1, 7, 63, 65, 257])
@pytest.mark.parametrize("side", [None, "left", "right"])
@IMPLS
def test_kernelized_matches_reference_float64(gen, n, side, impl):
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, n, side, gen) if side else None
    out = ops.kernelized_attention(q, k, v, key_padding_mask=mask, chunk_size=16, impl=impl)  # several query chunks
    ref = ops.kernelized_attention_reference(q, k, v, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [7, 65, 257])
@IMPLS
def test_kernelized_float32_within_1e5_of_float64_reference(gen, n, impl):
    q, k, v = (torch.randn(3, 2, n, 32, generator=gen) for _ in range(3))
    mask = mixed_mask(n)
    out = ops.kernelized_attention(q, k, v, key_padding_mask=mask, chunk_size=32, impl=impl)
    ref = ops.kernelized_attention_reference(q.double(), k.double(), v.double(), key_padding_mask=mask)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5  # measured ~4e-7 (both implementations)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernelized_parallel_half_keeps_large_norms_precise(gen, dtype):
    # |q_s|² ~ 5000 with each key near some query: C_ij = exp(q·k - |q|²/2 - |k|²/2) cancels large terms; the
    # parallel implementation's norms as 3 half columns (hi + mid + lo) keep float32's precision. Measured (10 seeds):
    # 1 column 1.5 / 1e8, 2 columns 7e-4 / 1.1e-2, 3 columns 7e-4 / 3.5e-3 (SDPA's half output) for fp16 / bf16
    n, d = 96, 32
    q = 30 * torch.randn(2, 2, n, d, generator=gen, dtype=torch.float64)
    k = q[:, :, torch.randperm(n, generator=gen)] + 0.3 * torch.randn(q.shape, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, n, d, generator=gen, dtype=torch.float64)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out = ops.kernelized_attention(q, k, v, impl="parallel")
    ref = ops.kernelized_attention_reference(q.double(), k.double(), v.double())
    assert out.dtype == dtype and rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 6e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernelized_parallel_half_gradients_are_float32_ones_rounded(gen, dtype):
    # the half norm columns' gradient (three columns, one norm) reaches q and k once; measured 6e-4 / 5e-3
    q, k, v = (torch.randn(2, 2, 37, 16, generator=gen) for _ in range(3))
    mask = mixed_mask(37)[:2]
    g = torch.randn(2, 2, 37, 16, generator=gen)
    grads = []
    for t in (torch.float32, dtype):
        inputs = [x.to(t).requires_grad_() for x in (q, k, v)]
        out = ops.kernelized_attention(*inputs, key_padding_mask=mask, impl="parallel")
        grads.append(torch.autograd.grad(out, inputs, g.to(t)))
    for want, got in zip(*grads):
        assert got.dtype == dtype and rel_err(got, want) < (3e-3 if dtype == torch.float16 else 2e-2)


def test_kernelized_is_unnormalised_gaussian_kernel_times_values(gen):
    # C_ij = exp(-|q_i - k_j|²/2) after D^(-1/4) scaling; identical q and k give C_ii = 1
    q = torch.randn(1, 1, 5, 64, generator=gen, dtype=torch.float64)
    c = kernelized_kernel_matrix(q, q)
    torch.testing.assert_close(torch.diagonal(c, dim1=-2, dim2=-1), torch.ones(1, 1, 5, dtype=torch.float64))
    d2 = ((q[0, 0, 0] - q[0, 0, 1]) ** 2).sum() / 64 ** 0.5
    torch.testing.assert_close(c[0, 0, 0, 1], torch.exp(-d2 / 2))


@IMPLS
def test_kernelized_gradcheck(impl):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[False, False, False, False, True]])
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.kernelized_attention(q, k, v, key_padding_mask=mask, chunk_size=2, impl=impl), (q, k, v))


@IMPLS
def test_kernelized_ignores_padded_keys_and_values(gen, impl):
    n = 33
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen) for _ in range(3))
    mask = mixed_mask(n)
    pad = mask[:, None, :, None]
    out = ops.kernelized_attention(q, k, v, key_padding_mask=mask, impl=impl)
    out_big = ops.kernelized_attention(q, k.masked_fill(pad, float("inf")), v.masked_fill(pad, float("inf")),
                                       key_padding_mask=mask, impl=impl)
    torch.testing.assert_close(out_big, out, rtol=0, atol=0)


# ---------------------------------------------------------------- Skyformer landmarks

@pytest.mark.parametrize("training", [True, False])
def test_landmarks_are_distinct_non_padded_rows_split_by_mode(gen, training):
    n = 40
    mask = mixed_mask(n)
    valid = ~mask
    for mode, d in (("stratified", 1), ("stratified", 9), ("uniform", 1), ("uniform", 9)):
        idx, used = _landmark_indices(valid, d, mode, gen, training)
        assert idx.shape == (3, d) and used.all()
        valid2 = torch.cat([valid, valid], dim=1)
        for b in range(3):
            assert len(set(idx[b].tolist())) == d  # without replacement
            assert valid2[b, idx[b]].all()  # never a padded Q or K row
            if mode == "stratified":
                assert (idx[b] < n).sum() == d - d // 2 and (idx[b] >= n).sum() == d // 2  # Q rows, K rows


@pytest.mark.parametrize("mode", ["stratified", "uniform"])
def test_landmarks_are_all_valid_rows_when_too_few(gen, mode):
    n = 10
    mask = mixed_mask(n)  # 10, 7 and 8 valid tokens
    idx, used = _landmark_indices(~mask, 64, mode, gen, True)
    assert idx.shape == (3, 2 * n)
    for b in range(3):
        expected = torch.cat([(~mask[b]).nonzero()[:, 0], (~mask[b]).nonzero()[:, 0] + n])
        assert sorted(idx[b, used[b]].tolist()) == expected.tolist()


# ---------------------------------------------------------------- Skyformer vs exact kernelized

@pytest.mark.parametrize("mode", ["stratified", "uniform"])
@pytest.mark.parametrize("training", [True, False])
@IMPLS
def test_skyformer_with_every_row_a_landmark_and_no_ridge_is_exact(gen, mode, training, impl):
    # Nyström with all 2N rows as landmarks and M = kappa(X, X) reproduces C exactly (G G^+ G = G)
    n = 63
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = mixed_mask(n)
    out = ops.skyformer_attention(q, k, v, num_landmarks=2 * n, key_padding_mask=mask, mode=mode,
                                  exact_inverse=True, gamma=0.0, generator=gen, training=training, impl=impl)
    ref = ops.skyformer_attention_reference(q, k, v, key_padding_mask=mask)
    for b in range(3):
        assert rel_err(rows(out, mask, b), rows(ref, mask, b)) < 1e-8


@IMPLS
def test_skyformer_with_every_row_a_landmark_is_the_ridge_nystrom_form(gen, impl):
    # gamma = 0.1 (the default) makes it C_Q (G + gamma I)^-1 C_K^T over the valid rows, not C itself
    n, gamma = 65, 0.1
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = mixed_mask(n)
    out = ops.skyformer_attention(q, k, v, num_landmarks=4 * n, key_padding_mask=mask, exact_inverse=True, impl=impl)
    newton = skyformer_kernel_matrix(q, k, num_landmarks=4 * n, key_padding_mask=mask)
    exact = kernelized_kernel_matrix(q, k, key_padding_mask=mask)
    scale = 16 ** -0.25
    for b in range(3):
        keep = ~mask[b]
        qs, ks = q[b][:, keep] * scale, k[b][:, keep] * scale
        x = torch.cat([qs, ks], dim=1)
        g = gaussian_kernel(x, x) + gamma * torch.eye(x.shape[1], dtype=x.dtype)
        c_q, c_k = gaussian_kernel(qs, x), gaussian_kernel(ks, x)
        direct = c_q @ torch.linalg.solve(g, c_k.transpose(-1, -2) @ v[b][:, keep])
        assert rel_err(rows(out, mask, b), direct) < 1e-8
        c_b, n_b = exact[b][:, keep][:, :, keep], newton[b][:, keep][:, :, keep]
        # the ridge costs little accuracy: measured ~3e-3 (exact inverse) and ~9e-3 (6 Newton steps)
        ridge = c_q @ torch.linalg.solve(g, c_k.transpose(-1, -2))
        assert spectral_error(ridge, c_b) < 0.02
        assert spectral_error(n_b, c_b) < 0.05


@IMPLS
def test_skyformer_attention_equals_its_kernel_matrix_times_values(gen, impl):
    n = 65
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = mixed_mask(n)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    out = ops.skyformer_attention(q, k, v, num_landmarks=17, key_padding_mask=mask, mode="uniform",
                                  generator=torch.Generator().manual_seed(seed), impl=impl)
    c = skyformer_kernel_matrix(q, k, num_landmarks=17, key_padding_mask=mask, mode="uniform",
                                generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(out, c @ v.masked_fill(mask[:, None, :, None], 0.0), rtol=1e-10, atol=1e-12)
    assert (c.masked_select(mask[:, None, None, :]) == 0).all()  # padded keys' columns are zero


def test_newton_schulz_inverts_a_well_conditioned_normalised_kernel(gen):
    # D = 64 keeps random landmarks far apart (M_hat near I); 6 steps then reach rounding (300 seeds: <= 5e-16)
    land = torch.randn(2, 32, 64, generator=gen, dtype=torch.float64) * 64 ** -0.25
    m = gaussian_kernel(land, land) + 0.1 * torch.eye(32, dtype=torch.float64)
    d = m.sum(-1).rsqrt()
    m_hat = m * d[..., :, None] * d[..., None, :]
    eye = torch.eye(32, dtype=torch.float64).expand(2, 32, 32)
    torch.testing.assert_close(newton_schulz_inverse(m_hat) @ m_hat, eye, rtol=0, atol=1e-8)


def _low_rank(gen, n, d, rank=4, noise=0.1):
    """'Trained-like' q, k: projections of a rank-4 latent plus small isotropic noise."""
    basis = torch.randn(rank, d, generator=gen, dtype=torch.float64)
    return [torch.randn(1, 2, n, rank, generator=gen, dtype=torch.float64) @ basis
            + noise * torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("inputs", ["gaussian", "low_rank"])
def test_skyformer_spectral_error_falls_as_landmarks_grow(mc_gen, inputs):
    # Skyformer Fig. 1; measured means (3 seeds, N=512, D=32): gaussian 0.87 / 0.58 / 0.22, low-rank 0.89 / 0.64 / 0.28
    n, d = 512, 32
    errors = {16: 0.0, 64: 0.0, 256: 0.0}
    for _ in range(3):
        if inputs == "gaussian":
            q, k = (torch.randn(1, 2, n, d, generator=mc_gen, dtype=torch.float64) for _ in range(2))
        else:
            q, k = _low_rank(mc_gen, n, d)
        exact = kernelized_kernel_matrix(q, k)
        for landmarks in errors:
            approx = skyformer_kernel_matrix(q, k, num_landmarks=landmarks, generator=mc_gen)
            errors[landmarks] += spectral_error(approx, exact) / 3
    print(inputs, errors)
    assert errors[16] > errors[64] > errors[256]
    assert errors[256] < 0.6 * errors[16]


# ---------------------------------------------------------------- Skyformer robustness

@pytest.mark.parametrize("training", [True, False])
@IMPLS
def test_skyformer_ignores_padded_keys_and_values(gen, training, impl):
    n = 47
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen) for _ in range(3))
    mask = mixed_mask(n)
    pad = mask[:, None, :, None]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    outs = [ops.skyformer_attention(q, kk, vv, num_landmarks=16, key_padding_mask=mask, training=training,
                                    generator=torch.Generator().manual_seed(seed), impl=impl)
            for kk, vv in ((k, v), (k.masked_fill(pad, float("inf")), v.masked_fill(pad, float("inf"))))]
    for b in range(3):
        torch.testing.assert_close(rows(outs[1], mask, b), rows(outs[0], mask, b), rtol=0, atol=0)


@IMPLS
def test_skyformer_fully_padded_element_gives_zeros_and_finite_grads(gen, impl):
    q, k, v = (torch.randn(2, 2, 9, 8, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1] = True
    out = ops.skyformer_attention(q, k, v, num_landmarks=4, key_padding_mask=mask, generator=gen, impl=impl)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("exact_inverse", [False, True])
@pytest.mark.parametrize("mode", ["stratified", "uniform"])
@IMPLS
def test_skyformer_backward_gives_finite_grads(gen, exact_inverse, mode, impl):
    n = 65
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen, requires_grad=True) for _ in range(3))
    out = ops.skyformer_attention(q, k, v, num_landmarks=15, key_padding_mask=mixed_mask(n), mode=mode,
                                  exact_inverse=exact_inverse, generator=gen, impl=impl)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@IMPLS
def test_half_precision_is_finite_and_close_to_float32(gen, dtype, impl):
    n = 129
    q, k, v = (torch.randn(3, 2, n, 32, generator=gen).to(dtype) for _ in range(3))
    mask = mixed_mask(n)
    # output rounding only; measured 2e-4 / 1.7e-3, Kernelized's parallel implementation 4.5e-4 / 3.4e-3 (SDPA's half
    # output)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    skyformer_kwargs = {"num_landmarks": 32, "training": False, "impl": impl}  # eval: the same landmarks
    for fn, kwargs in ((ops.kernelized_attention, {"impl": impl}), (ops.skyformer_attention, skyformer_kwargs)):
        out = fn(q, k, v, key_padding_mask=mask, **kwargs)
        ref = fn(q.float(), k.float(), v.float(), key_padding_mask=mask, **kwargs)
        assert out.dtype == dtype and torch.isfinite(out).all()
        for b in range(3):
            assert rel_err(rows(out, mask, b), rows(ref, mask, b)) < tol


@IMPLS
def test_skyformer_eval_is_repeatable_and_training_redraws(gen, impl):
    q, k, v = (torch.randn(2, 2, 50, 16, generator=gen) for _ in range(3))
    mask = padding_mask(2, 50, "left", gen)
    run = lambda **kw: ops.skyformer_attention(q, k, v, num_landmarks=8, key_padding_mask=mask, impl=impl,  # noqa: E731
                                               **kw)
    torch.testing.assert_close(run(training=False), run(training=False), rtol=0, atol=0)
    assert not torch.allclose(run(training=True), run(training=True))  # torch's global RNG moves on
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    torch.testing.assert_close(run(generator=torch.Generator().manual_seed(seed)),
                               run(generator=torch.Generator().manual_seed(seed)), rtol=0, atol=0)


# ---------------------------------------------------------------- argument errors

@pytest.mark.parametrize("fn", [ops.kernelized_attention, ops.kernelized_attention_reference,
                                ops.skyformer_attention, ops.skyformer_attention_reference])
def test_causal_is_rejected_as_non_causal_method(fn):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="non-causal"):
        fn(q, q, q, causal=True)


@pytest.mark.parametrize("kwargs, name", [
    ({"num_landmarks": 0}, "num_landmarks"),
    ({"num_landmarks": 2.5}, "num_landmarks"),
    ({"mode": "random"}, "stratified"),
    ({"gamma": -0.1}, "gamma"),
    ({"generator": 3}, "generator"),
])
@pytest.mark.parametrize("fn", [ops.skyformer_attention, ops.skyformer_attention_reference])
def test_skyformer_bad_arguments_raise(fn, kwargs, name):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=name):
        fn(q, q, q, **kwargs)


def test_bad_shapes_and_chunk_size_raise():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.kernelized_attention(q, q, q, chunk_size=0)
    with pytest.raises(ValueError, match="same length"):
        ops.skyformer_attention(q, torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ops.skyformer_attention(q, q, q, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))

"""The instruments of the Skyformer Fig. 1 reproduction (linattn_tools/reproduce/fig1_approximations.py)
against closed forms and materialised cases."""
import math

import pytest
import torch

from linattn_tools.reproduce import fig1_approximations as fa


def _qkv(n=32, p=8, dv=5, heads=2, seed=0, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(heads, n, p, generator=gen, dtype=torch.float64),
            scale * torch.randn(heads, n, p, generator=gen, dtype=torch.float64),
            torch.randn(heads, n, dv, generator=gen, dtype=torch.float64))


def test_softmax_output_is_the_materialised_softmax():
    q, k, v = _qkv()
    scores = torch.einsum("hip,hjp->hij", q, k) / math.sqrt(q.shape[-1])
    weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
    assert torch.allclose(fa.softmax_output(q, k, v), weights @ v)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_performer_features_estimate_exp_of_the_dot_product_without_bias(orthogonal):
    gen = torch.Generator().manual_seed(1)
    x = 0.4 * torch.randn(2, 6, generator=gen, dtype=torch.float64)
    estimates = []
    for _ in range(400):
        w = fa.gaussian_features(48, 6, orthogonal=orthogonal, generator=gen)
        f = fa.performer_features(x, w)
        estimates.append(f[0] @ f[1])
    assert torch.stack(estimates).mean().item() == pytest.approx(math.exp((x[0] @ x[1]).item()), rel=0.01)


def test_orthogonal_features_are_orthogonal_within_a_block():
    w = fa.gaussian_features(8, 8, orthogonal=True, generator=torch.Generator().manual_seed(0))
    gram = w @ w.T
    assert torch.allclose(gram - torch.diag(gram.diagonal()), torch.zeros(8, 8, dtype=w.dtype), atol=1e-10)


def test_performer_output_approaches_softmax_with_many_features():
    q, k, v = _qkv()
    exact = fa.softmax_output(q, k, v)
    gen = torch.Generator().manual_seed(0)
    few = fa.spectral_error(fa.performer_output(q, k, v, 8, gen), exact).mean()
    many = fa.spectral_error(fa.performer_output(q, k, v, 4096, gen), exact).mean()
    assert many < few and many / fa.spectral_error(torch.zeros_like(exact), exact).mean() < 0.05


def test_nystromformer_with_every_point_a_landmark_is_exact():
    q, k, v = _qkv()
    out = fa.nystromformer_output(q, k, v, q.shape[-2], iterations=None)
    assert torch.allclose(out, fa.softmax_output(q, k, v), atol=1e-8)


def test_nystromformer_iteration_converges_to_the_inverse():
    a = torch.softmax(torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    assert torch.allclose(fa.iterative_pinv(a, 30), torch.linalg.inv(a), atol=1e-8)
    assert not torch.allclose(fa.iterative_pinv(a, 1), torch.linalg.inv(a), atol=1e-3)


def test_segment_means():
    x = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    assert torch.equal(fa.segment_means(x, 3), torch.tensor([[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]],
                                                             dtype=torch.float64))
    with pytest.raises(ValueError):
        fa.segment_means(x, 4)


def test_skyformer_caption_with_every_row_a_landmark_is_exact():
    # d = 2N: S^T B̄ S = B̄, and B̄ B̄^+ B̄ = B̄, so Ã = A and the output is softmax's
    q, k, v = _qkv(n=16)
    out = fa.skyformer_caption_output(q, k, v, 32, torch.Generator().manual_seed(0))
    assert torch.allclose(out, fa.softmax_output(q, k, v), atol=1e-7)


def test_skyformer_caption_is_eq5_on_the_raw_score_matrix():
    q, k, v = _qkv(n=16)
    p = q.shape[-1]
    out = fa.skyformer_caption_output(q, k, v, 6, torch.Generator().manual_seed(3))
    idx = torch.randperm(32, generator=torch.Generator().manual_seed(3))[:6]
    x = torch.cat([q, k], dim=-2)
    b = torch.exp(x @ x.transpose(-1, -2) / math.sqrt(p))                  # Eq. (4)
    bs = b[..., idx]
    b_tilde = bs @ torch.linalg.pinv(bs[..., idx, :], hermitian=True) @ bs.transpose(-1, -2)  # Eq. (5)
    a_tilde = b_tilde[..., :16, 16:]                                       # Eq. (6)
    assert torch.allclose(out, (a_tilde @ v) / a_tilde.sum(-1, keepdim=True), rtol=1e-6, atol=1e-8)


def test_linformer_with_identity_projections_is_exact():
    q, k, v = _qkv()
    eye = torch.eye(q.shape[-2], dtype=q.dtype)
    out = fa.linformer_output(q, k, v, q.shape[-2], projections=torch.stack([eye, eye]))
    assert torch.allclose(out, fa.softmax_output(q, k, v))


def test_spectral_error_is_the_largest_singular_value():
    a = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64))
    assert fa.spectral_error(a, torch.zeros_like(a)).item() == pytest.approx(5.0)

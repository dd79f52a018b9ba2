"""The softmax baseline: SDPA path vs the materialised formula, with causal and padding masks."""
import pytest
import torch
from conftest import padding_mask

from linattn import ops


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 7, 65])
@pytest.mark.parametrize("side", ["left", "right", None])
def test_softmax_matches_reference(gen, causal, n, side):
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, n, side, gen) if side else None
    out = ops.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    ref = ops.softmax_attention_reference(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(out).all()


def test_softmax_rows_without_keys_are_zero_with_finite_grads():
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, True, False, False]])  # left padding: queries 0, 1 see nothing causally
    out = ops.softmax_attention(q, k, v, causal=True, key_padding_mask=mask)
    assert torch.equal(out[0, 0, :2], torch.zeros(2, 8))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_softmax_cross_attention_lengths(gen):
    q = torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(ops.softmax_attention(q, k, v), ops.softmax_attention_reference(q, k, v))

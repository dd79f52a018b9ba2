"""The softmax baseline: SDPA path vs the materialised formula, with causal and padding masks."""
import pytest
import torch
from helpers import padding_mask

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


@pytest.mark.parametrize("side", ["left", "right", None])
def test_causal_softmax_with_more_keys_than_queries_aligns_the_last_query_with_the_last_key(gen, side):
    """Queries are the last N of S positions (a prompt continued): they are the last N rows of the full causal
    attention, in the op and in the reference."""
    s, n = 9, 4
    q, k, v = (torch.randn(2, 3, s, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, s, side, gen) if side else None
    full = ops.softmax_attention_reference(q, k, v, causal=True, key_padding_mask=mask)[:, :, -n:]
    for op in (ops.softmax_attention, ops.softmax_attention_reference):
        torch.testing.assert_close(op(q[:, :, -n:], k, v, causal=True, key_padding_mask=mask), full,
                                   rtol=1e-10, atol=1e-12)


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

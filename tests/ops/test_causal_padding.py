"""Every causal op with padding on the left and on the right equals its float64 reference in values and gradients.

Padded keys and values hold huge entries (1e3): a padded key that reaches a stabilising shift (LLN's per-chunk
key maxima, a softmax's row max) then makes every real key's feature underflow to 0, and a padded value that
reaches an output shows up at once, so a mask forgotten anywhere fails here even where it would only shift
values that cancel with ordinary inputs.
"""
import functools

import pytest
import torch
from helpers import assert_same_values_and_grads, padding_mask

from linattn import ops

B, H, D = 3, 2, 6
HUGE = 1e3
IMPLS = ["parallel", "looped"]  # the implementations of LLN's, LLN+Diag's and block softmax's ops (linattn.ops.impls)


def _mask(gen, n):
    """(B, n): sequence 0 unpadded, 1 padded on the left, 2 on the right (random amounts < n)."""
    return torch.cat([padding_mask(2, n, "left", gen), padding_mask(2, n, "right", gen)[1:]])


def _inputs(gen, n, mask):
    """q, k, v (B,H,n,D) float64 requiring grad; padded keys and values HUGE."""
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for _ in range(3))
    pad = mask[:, None, :, None]
    k, v = k.masked_fill(pad, HUGE), v.masked_fill(pad, -HUGE)
    return tuple(t.requires_grad_() for t in (q, k, v))


def _check(gen, op, reference, n, extra=(), **kw):
    """op(q, k, v, *extra, causal=True, mask) == reference(...) in values and in every input's gradient."""
    mask = _mask(gen, n)
    q, k, v = _inputs(gen, n, mask)
    out = op(q, k, v, *extra, causal=True, key_padding_mask=mask, **kw)
    ref = reference(q, k, v, *extra, causal=True, key_padding_mask=mask, **kw)
    assert torch.isfinite(out).all()
    learnt = [t for t in extra if torch.is_tensor(t) and t.requires_grad]
    assert_same_values_and_grads(out, ref, (q, k, v, *learnt), gen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,chunk_size", [(23, 4), (17, 1), (9, 64)])
def test_causal_lln_with_left_and_right_padding(gen, n, chunk_size, impl):
    alpha = torch.rand(1, H, 1, 1, generator=gen, dtype=torch.float64) + 0.5
    kw = dict(extra=(alpha, torch.tensor(0.8, dtype=torch.float64)))
    op = lambda *a, **k: ops.lln_attention(*a, chunk_size=chunk_size, impl=impl, **k)
    _check(gen, op, ops.lln_attention_reference, n, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mix", ["average", "learnable_ratio"])
def test_causal_lln_diag_with_left_and_right_padding(gen, mix, impl):
    r = torch.rand(H, D, generator=gen, dtype=torch.float64)
    kw = dict(block_size=5, chunk_size=4, mix=mix, r=r)
    op = functools.partial(ops.lln_diag_attention, impl=impl)
    _check(gen, op, ops.lln_diag_attention_reference, 23, extra=(1.3, 0.7), **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,block_size", [(23, 5), (7, 16)])
def test_causal_block_softmax_with_left_and_right_padding(gen, n, block_size, impl):
    op = functools.partial(ops.block_softmax_attention, impl=impl)
    _check(gen, op, ops.block_softmax_attention_reference, n, block_size=block_size)


def test_causal_softmax_with_left_and_right_padding(gen):
    _check(gen, ops.softmax_attention, ops.softmax_attention_reference, 19)


@pytest.mark.parametrize("impl", ["parallel", "looped"])
@pytest.mark.parametrize("n,window,r", [(23, 4, 3), (10, 3, D), (5, 8, 2)])
def test_causal_lavo_with_left_and_right_padding(gen, n, window, r, impl):
    bases = torch.linalg.qr(torch.randn(H, D, D, generator=gen, dtype=torch.float64))[0][..., :r].transpose(1, 2)
    pos_bias = 0.5 * torch.randn(H, 2 * window - 1, generator=gen, dtype=torch.float64)
    extra = (bases.contiguous().requires_grad_(), pos_bias.requires_grad_())
    op = lambda *a, **k: ops.lavo_attention(*a, impl=impl, **k)
    _check(gen, op, ops.lavo_attention_reference, n, extra=extra, window=window)

"""LAVO fast path processed one window per pass: reference and float64 gradcheck across pass boundaries."""
import conftest
import pytest
import torch

from linattn import ops
from linattn.ops import working_set


@pytest.fixture
def one_window_per_pass(monkeypatch):
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)


def _inputs(gen, b, h, n, d, w, r):
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    bases = ops.lavo_init_bases(h, r, d, dtype=torch.float64)
    pos_bias = 0.5 * torch.randn(h, 2 * w - 1, generator=gen, dtype=torch.float64)
    return q, k, v, bases, pos_bias


def _mask(b, n):
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, n - n // 3:] = True  # right padding
    mask[-1, : n // 4] = True  # left padding
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n", [12, 14])
def test_lavo_in_many_passes_matches_reference(gen, one_window_per_pass, causal, padded, n):
    args = _inputs(gen, 2, 3, n, 4, 3, 2)
    mask = _mask(2, n) if padded else None
    out = ops.lavo_attention(*args, window=3, causal=causal, key_padding_mask=mask)
    ref = ops.lavo_attention_reference(*args, window=3, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_lavo_gradcheck_float64_in_many_passes(gen, one_window_per_pass, causal, padded):
    args = [t.requires_grad_() for t in _inputs(gen, 2, 2, 8, 3, 3, 2)]
    mask = _mask(2, 8) if padded else None
    assert torch.autograd.gradcheck(
        lambda *a: ops.lavo_attention(*a, window=3, causal=causal, key_padding_mask=mask), args)


# Group shapes of ops/windows.py at w = 3, D = 4 and N = 12 or 14 (4 or 5 windows a head): one window, two
# windows of one head (a group's first window reads the window before it from the group before), whole heads
# (window 0 of a head sits right after the previous head's last window, 2 × 3 heads: across the batch too).
GROUP_WORK = {"one-window": 1, "two-windows": 2 * 3 * 4, "whole-heads": 1 << 20}


@pytest.mark.parametrize("n", [12, 14])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fairseq_layout", [False, True])
@pytest.mark.parametrize("work", GROUP_WORK)
def test_lavo_every_group_shape_and_layout_matches_reference(gen, monkeypatch, work, fairseq_layout, causal, padded, n):
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", GROUP_WORK[work])
    q, k, v, bases, pos_bias = _inputs(gen, 2, 3, n, 4, 3, 2)
    qkv = conftest.fairseq_layout(q, k, v) if fairseq_layout else (q, k, v)
    args = [t.requires_grad_() for t in (*qkv, bases, pos_bias)]
    kw = dict(window=3, causal=causal, key_padding_mask=_mask(2, n) if padded else None)
    conftest.assert_same_values_and_grads(ops.lavo_attention(*args, **kw), ops.lavo_attention_reference(*args, **kw),
                                          args, gen)

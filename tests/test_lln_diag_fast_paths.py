"""LLN+Diag (average, one fused op) and block softmax fast paths: reference and float64 gradcheck,
also with one block / one chunk per working pass."""
import conftest
import pytest
import torch
from conftest import padding_mask

from linattn import ops
from linattn.ops import working_set

IMPLS = ["parallel", "looped"]  # the ops' forms (linattn.ops.impls); working passes concern ``looped`` only


@pytest.fixture(params=[False, True], ids=["one-pass", "many-passes"])
def passes(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)  # LLN and block softmax read it


def _inputs(gen, b=2, h=2, n=11, d=3, dv=2):
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(b, h, n, dv, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_lln_diag_average_matches_reference(gen, passes, causal, padded, impl):
    q, k, v = _inputs(gen, n=13)
    mask = padding_mask(2, 13, "right", gen) if padded else None
    out = ops.lln_diag_attention(q, k, v, 1.3, 0.8, causal=causal, key_padding_mask=mask, block_size=4, chunk_size=2,
                                 impl=impl)
    ref = ops.lln_diag_attention_reference(q, k, v, 1.3, 0.8, causal=causal, key_padding_mask=mask, block_size=4)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_diag_average_gradcheck_float64(gen, passes, causal, impl):
    q, k, v = (t.requires_grad_() for t in _inputs(gen, b=2, h=1, n=7))
    mask = padding_mask(2, 7, "left", gen)
    fn = lambda q, k, v: ops.lln_diag_attention(q, k, v, 1.2, 0.9, causal=causal, key_padding_mask=mask,
                                                block_size=3, chunk_size=2, impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_block_softmax_gradcheck_float64(gen, passes, causal, padded, impl):
    q, k, v = (t.requires_grad_() for t in _inputs(gen, b=2, h=1, n=8))
    mask = padding_mask(2, 8, "left", gen) if padded else None
    fn = lambda q, k, v: ops.block_softmax_attention(q, k, v, block_size=3, causal=causal, key_padding_mask=mask,
                                                     impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v))


# Group shapes of ops/windows.py at block size 3, D = 3 and N = 12 or 13 (4 or 5 blocks a head): one block, two
# blocks of one head, whole heads (2 × 3 heads: across the batch too); the parallel form has no groups.
GROUP_WORK = {"one-block": 1, "two-blocks": 2 * 3 * 3, "whole-heads": 1 << 20}
WORK_FORMS = [(work, "looped") for work in GROUP_WORK] + [("whole-heads", "parallel")]


@pytest.mark.parametrize("op", ["block_softmax", "lln_diag"])
@pytest.mark.parametrize("n", [12, 13])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fairseq_layout", [False, True])
@pytest.mark.parametrize("work,impl", WORK_FORMS)
def test_every_block_group_shape_and_layout_matches_reference(gen, monkeypatch, work, impl, fairseq_layout, causal,
                                                              padded, n, op):
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", GROUP_WORK[work])
    qkv = _inputs(gen, b=2, h=3, n=n, d=3, dv=3)
    q, k, v = (t.requires_grad_() for t in (conftest.fairseq_layout(*qkv) if fairseq_layout else qkv))
    kw = dict(block_size=3, causal=causal, key_padding_mask=padding_mask(2, n, "left", gen) if padded else None)
    if op == "block_softmax":
        out = ops.block_softmax_attention(q, k, v, impl=impl, **kw)
        ref = ops.block_softmax_attention_reference(q, k, v, **kw)
    else:
        out = ops.lln_diag_attention(q, k, v, 1.3, 0.8, chunk_size=2, impl=impl, **kw)
        ref = ops.lln_diag_attention_reference(q, k, v, 1.3, 0.8, **kw)
    conftest.assert_same_values_and_grads(out, ref, (q, k, v), gen)

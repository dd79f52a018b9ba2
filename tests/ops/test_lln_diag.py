"""LLN+Diag and its block-diagonal softmax part vs materialised N×N references (LLN §4.2), and (below) both ops'
implementations (LLN+Diag's average as one fused op) in one and in many working passes: reference and float64
gradcheck."""
import helpers
import pytest
import torch
from helpers import LargestTensor, padding_mask, rel_err

from linattn import ops
from linattn.ops import working_set
from linattn.ops.lln_diag import mix_lln_diag

IMPLS = ["parallel", "looped"]  # the ops' implementations (linattn.ops.impls); working passes concern ``looped`` only


def qkv(gen, b=2, h=3, n=33, d=8, dtype=torch.float64):
    return tuple(torch.randn(b, h, n, d, generator=gen, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,block", [(1, 4), (7, 4), (63, 16), (65, 16), (257, 64), (20, 64)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_block_softmax_matches_reference(gen, causal, n, block, side, impl):
    q, k, v = qkv(gen, n=n)
    mask = padding_mask(2, n, side, gen)
    out = ops.block_softmax_attention(q, k, v, block_size=block, causal=causal, key_padding_mask=mask, impl=impl)
    ref = ops.block_softmax_attention_reference(q, k, v, block_size=block, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", [(5, 0), (3, 6), (0, 9)])
@pytest.mark.parametrize("op", ["block_softmax", "lln_diag"])
def test_blocks_count_each_rows_real_tokens(gen, op, left, right, causal, impl):
    """Padding anywhere changes no real token's output or gradient: the blocks are those of the real tokens alone
    (left padding used to shift every block by its length)."""
    fns = {"block_softmax": lambda *t, causal, mask: ops.block_softmax_attention(
        *t, block_size=4, causal=causal, key_padding_mask=mask, impl=impl),
        "lln_diag": lambda *t, causal, mask: ops.lln_diag_attention(
        *t, 1.3, 0.8, block_size=4, chunk_size=3, causal=causal, key_padding_mask=mask, impl=impl)}
    alone, padded = helpers.padded_row_against_alone(fns[op], gen, 11, left, right, causal)
    for a, b in zip(alone, padded):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_block_softmax_keeps_blocks_apart(gen, impl):
    q, k, v = qkv(gen, n=40)
    out = ops.block_softmax_attention(q, k, v, block_size=16, impl=impl)
    v2 = v.clone()
    v2[:, :, 16:32] += 5  # the middle block only
    out2 = ops.block_softmax_attention(q, k, v2, block_size=16, impl=impl)
    torch.testing.assert_close(out2[:, :, :16], out[:, :, :16])
    torch.testing.assert_close(out2[:, :, 32:], out[:, :, 32:])
    assert not torch.allclose(out2[:, :, 16:32], out[:, :, 16:32])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mix", ["average", "learnable_scale", "learnable_ratio"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [7, 65, 130])
def test_lln_diag_matches_reference(gen, mix, causal, n, impl):
    q, k, v = qkv(gen, n=n)
    mask = padding_mask(2, n, "right" if causal else "left", gen)
    r = torch.rand(3, 8, generator=gen, dtype=torch.float64)
    p = torch.rand(3, 8, generator=gen, dtype=torch.float64)
    kw = dict(block_size=16, causal=causal, key_padding_mask=mask, chunk_size=32, mix=mix, r=r, p=p)
    out = ops.lln_diag_attention(q, k, v, 1.1, 0.9, **kw, impl=impl)
    ref = ops.lln_diag_attention_reference(q, k, v, 1.1, 0.9, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_diag_average_is_the_mean_of_its_parts(gen, impl):
    q, k, v = qkv(gen, n=50)
    out = ops.lln_diag_attention(q, k, v, 1.0, 1.0, block_size=16, impl=impl)
    lln = ops.lln_attention_reference(q, k, v, 1.0, 1.0)
    diag = ops.block_softmax_attention_reference(q, k, v, block_size=16)
    torch.testing.assert_close(out, (lln + diag) / 2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_lln_diag_half_precision(gen, dtype, tol, impl):
    q, k, v = qkv(gen, n=100, d=32, dtype=torch.float32)
    mask = padding_mask(2, 100, "right", gen)
    half = [t.to(dtype) for t in (q, k, v)]
    out = ops.lln_diag_attention(*half, 1.0, 1.0, block_size=32, causal=True, key_padding_mask=mask, impl=impl)
    ref = ops.lln_diag_attention_reference(*(t.double() for t in half), 1.0, 1.0, block_size=32,
                                           causal=True, key_padding_mask=mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_lln_diag_ignores_future(gen, impl):
    q, k, v = (t.float() for t in qkv(gen, b=1, n=90, d=16))
    out = ops.lln_diag_attention(q, k, v, 1.0, 1.0, block_size=32, causal=True, impl=impl)
    for j in [5, 31, 32, 60, 89]:
        k2, v2 = k.clone(), v.clone()
        k2[:, :, j] *= 10
        v2[:, :, j] *= 10
        out2 = ops.lln_diag_attention(q, k2, v2, 1.0, 1.0, block_size=32, causal=True, impl=impl)
        assert ((out2[:, :, :j] - out[:, :, :j]).abs() <= 1e-6 * out[:, :, :j].abs().clamp_min(1e-3)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_diag_gradcheck(gen, impl):
    q, k, v = (t.requires_grad_() for t in qkv(gen, b=1, h=1, n=10, d=3))
    r = torch.rand(1, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, r: ops.lln_diag_attention(q, k, v, 1.0, 1.0, block_size=4, causal=True, chunk_size=4,
                                                   mix="learnable_ratio", r=r, impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v, r))


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_diag_is_linear_in_memory(impl):
    n = 2048
    q, k, v = (torch.randn(1, 1, n, 32, requires_grad=True) for _ in range(3))
    with LargestTensor() as probe:
        ops.lln_diag_attention(q, k, v, 1.0, 1.0, block_size=64, causal=True, impl=impl).sum().backward()
    assert probe.max_numel <= n * 64


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_diag_rejects_bad_input(impl):
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        ops.lln_diag_attention(q, q, q, 1.0, 1.0, block_size=0, impl=impl)
    with pytest.raises(ValueError, match="mix must be one of"):
        ops.lln_diag_attention(q, q, q, 1.0, 1.0, mix="sum", impl=impl)
    with pytest.raises(ValueError, match=r"needs p of shape \(H, Dv\)"):
        ops.lln_diag_attention(q, q, q, 1.0, 1.0, mix="learnable_scale", r=torch.ones(2, 4), impl=impl)


def test_mix_lln_diag_closed_forms_per_mode():
    # distinct r, p per head and channel, so swapping r and p, or r and 1 - r, changes the result
    lln = torch.tensor([2.0, -1.0, 4.0], dtype=torch.float64).view(1, 1, 1, 3).expand(2, 2, 4, 3)
    diag = torch.tensor([10.0, 6.0, -2.0], dtype=torch.float64).view(1, 1, 1, 3).expand(2, 2, 4, 3)
    r = torch.tensor([[0.1, 0.2, 0.3], [0.7, 0.8, 0.9]], dtype=torch.float64)
    p = torch.tensor([[1.5, 2.5, 3.5], [0.4, 0.6, 0.05]], dtype=torch.float64)
    average = torch.tensor([6.0, 2.5, 1.0], dtype=torch.float64)  # (LLN + Diag) / 2
    torch.testing.assert_close(mix_lln_diag(lln, diag, "average"), average.expand(2, 2, 4, 3))
    # learnable_scale r*LLN + p*Diag, head 0: (0.2 + 15, -0.2 + 15, 1.2 - 7), head 1: (1.4 + 4, -0.8 + 3.6, 3.6 - 0.1)
    scale = torch.tensor([[15.2, 14.8, -5.8], [5.4, 2.8, 3.5]], dtype=torch.float64)
    torch.testing.assert_close(mix_lln_diag(lln, diag, "learnable_scale", r, p),
                               scale[None, :, None, :].expand(2, 2, 4, 3))
    # learnable_ratio r*LLN + (1-r)*Diag, head 0: (0.2 + 9, -0.2 + 4.8, 1.2 - 1.4),
    # head 1: (1.4 + 3, -0.8 + 1.2, 3.6 - 0.2)
    ratio = torch.tensor([[9.2, 4.6, -0.2], [4.4, 0.4, 3.4]], dtype=torch.float64)
    torch.testing.assert_close(mix_lln_diag(lln, diag, "learnable_ratio", r, p),
                               ratio[None, :, None, :].expand(2, 2, 4, 3))


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
# blocks of one head, whole heads (2 × 3 heads: across the batch too); the parallel implementation has no groups.
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
    q, k, v = (t.requires_grad_() for t in (helpers.fairseq_layout(*qkv) if fairseq_layout else qkv))
    kw = dict(block_size=3, causal=causal, key_padding_mask=padding_mask(2, n, "left", gen) if padded else None)
    if op == "block_softmax":
        out = ops.block_softmax_attention(q, k, v, impl=impl, **kw)
        ref = ops.block_softmax_attention_reference(q, k, v, **kw)
    else:
        out = ops.lln_diag_attention(q, k, v, 1.3, 0.8, chunk_size=2, impl=impl, **kw)
        ref = ops.lln_diag_attention_reference(q, k, v, 1.3, 0.8, **kw)
    helpers.assert_same_values_and_grads(out, ref, (q, k, v), gen)

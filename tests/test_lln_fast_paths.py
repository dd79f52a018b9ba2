"""LLN fast paths processed in several working-size passes (groups of chunks): reference and gradcheck."""
import pytest
import torch
from conftest import padding_mask

from linattn import ops
from linattn.ops import working_set
from linattn.ops.lln import looped as lln_looped

IMPLS = ["parallel", "looped"]  # the ops' forms (linattn.ops.impls); working passes concern ``looped`` only


@pytest.fixture
def small_passes(monkeypatch):
    """One row (non-causal) or one chunk (causal) per pass: every pass boundary and carry is exercised."""
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)


def _inputs(gen, b=2, h=3, n=23, d=4, dv=5):
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(b, h, n, dv, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_lln_in_many_passes_matches_reference(gen, small_passes, causal, side):
    q, k, v = _inputs(gen)
    mask = padding_mask(2, 23, side, gen)
    alpha = torch.rand(1, 3, 1, 1, generator=gen, dtype=torch.float64) + 0.5
    out = ops.lln_attention(q, k, v, alpha, 0.7, causal=causal, key_padding_mask=mask, chunk_size=2)
    ref = ops.lln_attention_reference(q, k, v, alpha, 0.7, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,chunk_size", [(7, 2)])
def test_lln_gradcheck_float64_in_many_passes(gen, small_passes, causal, n, chunk_size):
    q, k, v = (t.requires_grad_() for t in _inputs(gen, b=2, h=2, n=n, d=2, dv=2))
    mask = padding_mask(2, n, "right", gen)
    alpha = torch.tensor([1.3, 0.8], dtype=torch.float64)[None, :, None, None]
    fn = lambda q, k, v: ops.lln_attention(q, k, v, alpha, 0.9, causal=causal, key_padding_mask=mask,
                                           chunk_size=chunk_size)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_learnt_scales_get_gradients(gen, causal, impl):
    q, k, v = _inputs(gen, b=1, h=2, n=9)
    alpha = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    beta = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: ops.lln_attention(q, k, v, a, b, causal=causal, chunk_size=4, impl=impl)
    assert torch.autograd.gradcheck(fn, (alpha, beta))


@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_lln_groups_of_several_chunks_reuse_their_buffers_exactly(gen, monkeypatch, side):
    # b*h*d*c = 48 values per row: 144 -> groups of 3 chunks of 2; N = 99 gives 16 such groups, then a
    # shorter last group of 2 chunks whose last chunk has 1 row (the working buffers are reused at a smaller size)
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", 144)

    class Poisoned(lln_looped._Scratch):  # every buffer handed out holds NaN: each must be written before it is read
        def __call__(self, name, *shape):
            return super().__call__(name, *shape).fill_(float("nan"))
    monkeypatch.setattr(lln_looped, "_Scratch", Poisoned)
    q, k, v = (t.requires_grad_() for t in _inputs(gen, n=99))
    mask = padding_mask(2, 99, side, gen)
    alpha = torch.tensor([1.3, 0.8, 1.1], dtype=torch.float64)[None, :, None, None]
    grad = torch.randn(2, 3, 99, 5, generator=gen, dtype=torch.float64)
    outs = [ops.lln_attention(q, k, v, alpha, 0.6, causal=True, key_padding_mask=mask, chunk_size=2),
            ops.lln_attention_reference(q, k, v, alpha, 0.6, causal=True, key_padding_mask=mask)]
    grads = [torch.autograd.grad(o, (q, k, v), grad) for o in outs]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for fast, ref in zip(*grads):
        torch.testing.assert_close(fast, ref, rtol=1e-8, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["lln", "causal_lln", "causal_lln_diag", "block_softmax"])
def test_parallel_forms_compile_without_graph_breaks_and_equal_eager(gen, op):
    """LLN (both modes), LLN+Diag's fused average and block softmax in their parallel forms under
    ``torch.compile(fullgraph=True, dynamic=True)``: values and gradients equal eager (one shape each)."""
    q, k, v = (t.float().requires_grad_() for t in _inputs(gen, n=23))
    mask = padding_mask(2, 23, "left", gen)
    alpha = torch.tensor([1.3, 0.8, 1.1])[None, :, None, None]

    def fn(q, k, v, mask, alpha):
        kw = dict(key_padding_mask=mask, impl="parallel")
        if op == "block_softmax":
            return ops.block_softmax_attention(q, k, v, causal=False, block_size=5, **kw)
        if op == "causal_lln_diag":
            return ops.lln_diag_attention(q, k, v, alpha, 0.6, causal=True, chunk_size=4, block_size=5, **kw)
        return ops.lln_attention(q, k, v, alpha, 0.6, causal=op == "causal_lln", chunk_size=4, **kw)

    got = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v, mask, alpha)
    want = fn(q, k, v, mask, alpha)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(want.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

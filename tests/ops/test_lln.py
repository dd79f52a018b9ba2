"""LLN attention, both implementations, against the materialised paper formula (LLN eq. 8-9): values, gradients,
half precision, decoding, argument errors, and (below) the looped implementation in several working-size passes
(groups of chunks), reference and gradcheck."""
import functools

import pytest
import torch
from helpers import LargestTensor, padding_mask, rel_err

from linattn import ops
from linattn.compile_shapes import compile_varying_lengths
from linattn.ops import working_set
from linattn.ops.lln import lln_decode_init, lln_decode_step
from linattn.ops.lln import looped as lln_looped

LENGTHS = [1, 7, 63, 65, 257]
IMPLS = ["parallel", "looped"]  # the ops' implementations (linattn.ops.impls); working passes concern ``looped`` only


def qkv(gen, b=2, h=3, n=33, d=16, dv=None, dtype=torch.float64, scale=1.0):
    dv = dv or d
    q = torch.randn(b, h, n, d, generator=gen, dtype=dtype) * scale
    k = torch.randn(b, h, n, d, generator=gen, dtype=dtype) * scale
    v = torch.randn(b, h, n, dv, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_lln_matches_reference_float64_with_padding(gen, causal, n, side, impl):
    q, k, v = qkv(gen, n=n, dv=12)
    mask = padding_mask(2, n, side, gen)
    alpha = torch.rand(1, 3, 1, 1, generator=gen, dtype=torch.float64) + 0.5  # per-head scales
    out = ops.lln_attention(q, k, v, alpha, 0.8, causal=causal, key_padding_mask=mask, chunk_size=16, impl=impl)
    ref = ops.lln_attention_reference(q, k, v, alpha, 0.8, causal=causal, key_padding_mask=mask)
    assert out.shape == (2, 3, n, 12)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 64, 1000])
def test_lln_fp32_matches_float64_reference(gen, causal, chunk_size, impl):
    q, k, v = qkv(gen, n=257, d=32)
    out = ops.lln_attention(q.float(), k.float(), v.float(), 1.5, 1.5, causal=causal, chunk_size=chunk_size, impl=impl)
    ref = ops.lln_attention_reference(q, k, v, 1.5, 1.5, causal=causal)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("causal", [False, True])
def test_lln_half_precision_is_finite_and_close(gen, dtype, tol, causal, impl):
    q, k, v = (t.to(dtype) for t in qkv(gen, n=130, d=64, dtype=torch.float32, scale=2.0))
    mask = padding_mask(2, 130, "right", gen)
    out = ops.lln_attention(q, k, v, 2.0, 2.0, causal=causal, key_padding_mask=mask, impl=impl)
    ref = ops.lln_attention_reference(q.double(), k.double(), v.double(), 2.0, 2.0, causal=causal,
                                      key_padding_mask=mask)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol  # bf16 has 8 mantissa bits (~4e-3 per rounding), fp16 11


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_large_exponents_stay_finite_and_exact(gen, causal, impl):
    # |alpha q| around 50: exp() of the raw features would overflow fp32 (max ~ e^88)
    q, k, v = qkv(gen, b=1, h=2, n=200, d=64)
    q = q / q.abs().amax() * 3
    k = k / k.abs().amax() * 3
    out = ops.lln_attention(q.float(), k.float(), v.float(), 50 / 3, 50 / 3, causal=causal, chunk_size=32, impl=impl)
    ref = ops.lln_attention_reference(q, k, v, 50 / 3, 50 / 3, causal=causal)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.xfail(strict=True, reason="known limit of the chunked causal form: its per-query and per-key "
                   "shifts (no future token) underflow when |alpha q|, |beta k| >~ 35 sit on different channels")
def test_causal_lln_misaligned_extreme_features_match_reference(impl):
    # exact value: both channels give exp(0), so out = v; the non-causal form and decoding get it right
    q, k, v = torch.tensor([[[[5.0, -5.0]]]]), torch.tensor([[[[-5.0, 5.0]]]]), torch.tensor([[[[1.0, 2.0]]]])
    torch.testing.assert_close(ops.lln_attention(q, k, v, 8.0, 8.0, causal=False, impl=impl), v)
    torch.testing.assert_close(ops.lln_attention(q, k, v, 8.0, 8.0, causal=True, impl=impl), v)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("target", ["k", "v", "extreme k"])
def test_causal_lln_ignores_future_keys_and_values(gen, target, impl):
    q, k, v = (t.float() for t in qkv(gen, b=1, h=2, n=150, d=32, scale=1.5))
    out = ops.lln_attention(q, k, v, 2.0, 2.0, causal=True, chunk_size=64, impl=impl)
    for j in [0, 1, 40, 63, 64, 100, 149]:  # first, mid-chunk, chunk edges, last
        k2, v2 = k.clone(), v.clone()
        if target == "extreme k":  # beta k = 80 on every feature: near exp's float32 overflow
            k2[:, :, j] = 40.0
        else:
            (k2 if target == "k" else v2)[:, :, j] *= 10
        out2 = ops.lln_attention(q, k2, v2, 2.0, 2.0, causal=True, chunk_size=64, impl=impl)
        past = out[:, :, :j]
        assert ((out2[:, :, :j] - past).abs() <= 1e-6 * past.abs().clamp_min(1e-3)).all(), j
        if j < 149 and target == "v":
            assert not torch.allclose(out2[:, :, j], out[:, :, j])  # the change itself is seen


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_padded_keys_and_values_change_nothing(gen, causal, impl):
    q, k, v = qkv(gen, n=70)
    mask = padding_mask(2, 70, "left" if not causal else "right", gen)
    out = ops.lln_attention(q, k, v, 1.0, 1.0, causal=causal, key_padding_mask=mask, chunk_size=16, impl=impl)
    k2 = k.masked_fill(mask[:, None, :, None], 1e3)
    v2 = v.masked_fill(mask[:, None, :, None], 1e3)
    out2 = ops.lln_attention(q, k2, v2, 1.0, 1.0, causal=causal, key_padding_mask=mask, chunk_size=16, impl=impl)
    keep = ~mask[:, None, :, None].expand_as(out)
    assert torch.isfinite(out2).all()
    torch.testing.assert_close(out2[keep], out[keep], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_all_padding_gives_zeros_not_nan(causal, impl):
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    mask = torch.ones(1, 9, dtype=torch.bool)
    out = ops.lln_attention(q, k, v, 1.0, 1.0, causal=causal, key_padding_mask=mask, impl=impl)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_gradcheck(gen, causal, impl):
    q, k, v = (t.requires_grad_() for t in qkv(gen, b=1, h=2, n=11, d=4))
    mask = torch.zeros(1, 11, dtype=torch.bool)
    mask[0, -2:] = True
    fn = lambda q, k, v: ops.lln_attention(q, k, v, 1.2, 0.9, causal=causal, key_padding_mask=mask, chunk_size=4,
                                           impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,chunk_size", [(37, 4), (16, 4), (5, 8)])
def test_causal_lln_gradcheck_without_padding_over_many_chunks(gen, n, chunk_size, impl):
    """Many chunks exercise every level of the state scan in the forward and the backward."""
    q, k, v = (t.requires_grad_() for t in qkv(gen, b=2, h=1, n=n, d=3))
    fn = lambda q, k, v: ops.lln_attention(q, k, v, 1.1, 1.3, causal=True, chunk_size=chunk_size, impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_incremental_decoding_equals_full_causal_forward(gen, impl):
    q, k, v = (t.float() for t in qkv(gen, n=77, d=16, dv=8, scale=2.0))
    full = ops.lln_attention(q, k, v, 1.7, 1.7, causal=True, chunk_size=16, impl=impl)
    s, shift = lln_decode_init(2, 3, 16, 8)
    steps = []
    for t in range(77):
        o, s, shift = lln_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], 1.7, 1.7, s, shift)
        steps.append(o)
    assert s.shape == (2, 3, 16, 9)  # O(D Dv) state whatever the context length
    assert rel_err(torch.cat(steps, 2), full) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_lln_never_materialises_n_by_n(causal, impl):
    n, d, c = 2048, 32, 64
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    with LargestTensor() as probe:
        ops.lln_attention(q, k, v, 1.0, 1.0, causal=causal, chunk_size=c, impl=impl).sum().backward()
    # largest tensors: (N/C) chunks of C×C intra weights, (N/C) states of D×(D+1), N×D features
    assert probe.max_numel <= n * max(c, d + 1)
    assert probe.max_numel < n * n / 8


@pytest.mark.parametrize("impl", IMPLS)
def test_lln_rejects_bad_input(impl):
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="q must have shape"):
        ops.lln_attention(q[0], q, q, 1.0, 1.0, impl=impl)
    with pytest.raises(ValueError, match="same dtype"):
        ops.lln_attention(q, q.double(), q, 1.0, 1.0, impl=impl)
    with pytest.raises(ValueError, match="same device"):
        ops.lln_attention(q, q.to("meta"), q, 1.0, 1.0, impl=impl)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        ops.lln_attention(q, q, q, 1.0, 1.0, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool), impl=impl)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        ops.lln_attention(q, q, q, 1.0, 1.0, causal=True, chunk_size=0, impl=impl)
    with pytest.raises(ValueError, match="alpha must be finite and > 0"):
        ops.lln_attention(q, q, q, 0.0, 1.0, impl=impl)
    with pytest.raises(ValueError, match="beta must be finite and > 0"):
        ops.lln_attention(q, q, q, 1.0, -2.0, impl=impl)
    with pytest.raises(RuntimeError, match="alpha must be finite and > 0"):  # a tensor: checked on its device
        ops.lln_attention(q, q, q, torch.tensor([float("nan")]), 1.0, impl=impl)
    with pytest.raises(RuntimeError, match="beta must be finite and > 0"):
        ops.lln_attention(q, q, q, 1.0, torch.tensor(-1.0), impl=impl)
    with pytest.raises(RuntimeError, match="alpha must be finite and > 0"):
        ops.lln_attention(q, q, q, torch.tensor(float("inf")), 1.0, impl=impl)
    with pytest.raises(ValueError, match="alpha must be broadcastable"):
        ops.lln_attention(q, q, q, torch.ones(3), 1.0, impl=impl)
    with pytest.raises(ValueError, match="same length"):
        ops.lln_attention(q, q[:, :, :3], q[:, :, :3], 1.0, 1.0, causal=True, impl=impl)


def test_scale_shapes_are_checked_once_per_shape_and_heads():
    """A scale's shape is checked once per shape and q's (B, H) (``inputs._scale_shape``): a shape met before
    against other heads, or another shape, is still refused."""
    q2, q3 = torch.randn(1, 2, 5, 4), torch.randn(1, 3, 5, 4)
    two = torch.full((1, 2, 1, 1), 0.5)
    ops.lln_attention(q2, q2, q2, two, two, impl="parallel")
    with pytest.raises(ValueError, match="alpha must be broadcastable"):
        ops.lln_attention(q3, q3, q3, two, 0.5, impl="parallel")
    with pytest.raises(ValueError, match="beta must be broadcastable"):
        ops.lln_attention(q2, q2, q2, two, two.view(1, 1, 2, 1), impl="parallel")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("which", ["alpha", "beta"])
def test_tensor_scales_are_checked_on_the_device_in_one_assertion(which, bad):
    """alpha and beta as tensors (the moment matcher's, per head): both checked by one device assertion (a forward
    runs it every time: four launches for the pair, not ten), which still fails for a bad value in either, on any
    head, naming both."""
    from linattn_tools.benchmark.dispatch import count_dispatch

    q = torch.randn(1, 2, 5, 4)
    good = torch.full((1, 2, 1, 1), 0.5)
    scales = {"alpha": good, "beta": good.clone()}
    scales[which] = torch.tensor([0.5, bad]).view(1, 2, 1, 1)
    with pytest.raises(RuntimeError, match=f"{which} must be finite and > 0"):
        ops.lln_attention(q, q, q, scales["alpha"], scales["beta"], impl="parallel")
    with count_dispatch() as counts:
        ops.lln_attention(q, q, q, good, good, impl="parallel")
    with count_dispatch() as unchecked:  # Python numbers: checked on the host
        ops.lln_attention(q, q, q, 0.5, 0.5, impl="parallel")
    assert counts.ops["_assert_async"] == 1
    assert counts.ops - unchecked.ops == {"cat": 1, "nan_to_num": 1, "gt": 1, "all": 1, "_assert_async": 1}


@pytest.mark.parametrize("causal", [False, True])
def test_fused_reads_the_checked_scales_per_head_with_no_stack_of_its_own(causal):
    """Tensor alpha, beta (the moment matcher's) are stacked per head (B, H) by their check, and the fused kernels
    read that stack as it is: the check adds its four launches and nothing else to the call with Python numbers
    (whose stack the fused op makes itself); the values reach the kernels, and a bad one still fails."""
    pytest.importorskip("triton", minversion="3.9")
    from linattn_tools.benchmark.dispatch import count_dispatch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=gen).bfloat16() for _ in range(3))
    alpha, beta = torch.tensor([0.5, 0.7]).view(1, 2, 1, 1), torch.tensor([0.6, 0.4]).view(1, 2, 1, 1)
    run = functools.partial(ops.lln_attention, q, k, v, causal=causal, chunk_size=4)
    with count_dispatch() as counts:
        out = run(alpha, beta, impl="fused")
    with count_dispatch() as unchecked:
        run(0.5, 0.5, impl="fused")
    assert counts.ops - unchecked.ops == {"nan_to_num": 1, "gt": 1, "all": 1, "_assert_async": 1}
    assert unchecked.ops - counts.ops == {}
    want = ops.lln_attention(q.double(), k.double(), v.double(), alpha, beta, causal=causal, impl="parallel")
    assert rel_err(out.double(), want) < 1e-2
    with pytest.raises(RuntimeError, match="alpha must be finite and > 0 or beta must be finite and > 0"):
        run(alpha, torch.tensor([0.6, float("nan")]).view(1, 2, 1, 1), impl="fused")


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


@pytest.mark.extended  # compile handling: CI compiles one module case (tests/plugin/test_attention_compile.py)
@pytest.mark.parametrize("op", ["lln", "causal_lln", "block_softmax"])
def test_parallel_forms_compile_without_graph_breaks_and_equal_eager(gen, op):
    """LLN (both modes) and block softmax in their parallel implementations under ``compile_varying_lengths(fn,
    fullgraph=True)`` (as ``--attention-compile`` compiles them): values and gradients equal eager (one shape each).
    LLN+Diag, their average, compiles in tests/plugin/test_attention_compile.py: its causal module's step (the op
    and its moment matcher: one graph, eager's values and gradients), and non-causal on torch 2.11; its own case
    here cost 7 more minutes of Inductor on 2 cores and checked nothing those do not."""
    q, k, v = (t.float().requires_grad_() for t in _inputs(gen, n=23))
    mask = padding_mask(2, 23, "left", gen)
    alpha = torch.tensor([1.3, 0.8, 1.1])[None, :, None, None]

    def fn(q, k, v, mask, alpha):
        kw = dict(key_padding_mask=mask, impl="parallel")
        if op == "block_softmax":
            return ops.block_softmax_attention(q, k, v, causal=False, block_size=5, **kw)
        return ops.lln_attention(q, k, v, alpha, 0.6, causal=op == "causal_lln", chunk_size=4, **kw)

    got = compile_varying_lengths(fn, fullgraph=True)(q, k, v, mask, alpha)
    want = fn(q, k, v, mask, alpha)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(want.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

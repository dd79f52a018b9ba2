"""LAVO's two implementations (``impl``: parallel, every window at once; looped, windows in working-size groups)
against the float64 reference and each other: tiny and odd lengths in fairseq's layout, large scores, exact
causality, the bytes saved for backward in half precision, the meta device and ``torch.compile``. Below: the looped
implementation one window per pass, reference and float64 gradcheck across pass boundaries."""
import helpers
import pytest
import torch

from dev.perf.saved import saved_bytes
from linattn import ops
from linattn.compile_shapes import compile_varying_lengths
from linattn.ops import working_set

IMPLS = ["parallel", "looped"]


def _inputs(gen, n, w, r, b=2, h=3, d=8, dtype=torch.float64):
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    bases = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0][..., :r].transpose(1, 2)
    pos_bias = 0.5 * torch.randn(h, 2 * w - 1, generator=gen, dtype=torch.float64)
    return [t.contiguous().to(dtype) for t in (q, k, v, bases, pos_bias)]


def _mask(n, b=2):
    """Row 0 left-padded, row 1 right-padded (each keeps at least one real token)."""
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, : n // 3] = True
    mask[1, n - n // 4:] = True
    return mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,w", [(1, 4), (2, 4), (3, 2), (7, 4), (65, 8), (65, 64)])
def test_lavo_tiny_and_odd_lengths_in_fairseq_layout_match_reference(gen, impl, causal, n, w):
    q, k, v, bases, pos_bias = _inputs(gen, n, w, 5)
    args = [t.requires_grad_() for t in (*helpers.fairseq_layout(q, k, v), bases, pos_bias)]
    kw = dict(window=w, causal=causal, key_padding_mask=_mask(n))
    helpers.assert_same_values_and_grads(ops.lavo_attention(*args, impl=impl, **kw),
                                          ops.lavo_attention_reference(*args, **kw), args, gen)


@pytest.mark.parametrize("causal", [True, False])
def test_lavo_parallel_equals_looped_with_values_and_gradients(gen, causal):
    args = [t.requires_grad_() for t in _inputs(gen, 45, 6, 8, b=3, h=4, d=8)]
    kw = dict(window=6, causal=causal, key_padding_mask=torch.cat([_mask(45), torch.zeros(1, 45, dtype=bool)]))
    helpers.assert_same_values_and_grads(ops.lavo_attention(*args, impl="parallel", **kw),
                                          ops.lavo_attention(*args, impl="looped", **kw), args, gen,
                                          rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
def test_lavo_large_scores_stay_finite_and_exact(gen, impl, causal):
    """|q|, |k| ≈ 50 per entry: window scores of thousands, memory scores of hundreds (max-shifted softmaxes)."""
    q, k, v, bases, pos_bias = _inputs(gen, 29, 4, 6)
    q, k = 50 * q.sign(), 50 * k.sign() + 0.1 * k
    args = [t.float().requires_grad_() for t in (q, k, v, bases, pos_bias)]
    ref = ops.lavo_attention_reference(*(t.double() for t in args), window=4, causal=causal,
                                       key_padding_mask=_mask(29))
    out = ops.lavo_attention(*args, window=4, causal=causal, key_padding_mask=_mask(29), impl=impl)
    out.square().sum().backward()
    assert all(torch.isfinite(t).all() for t in [out] + [a.grad for a in args])
    assert helpers.rel_err(out, ref) < 1e-3  # fp32 scores of ~7000 are exact to ~4e-4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("j", [1, 5, 8, 13])
def test_causal_lavo_past_outputs_are_bitwise_independent_of_future_tokens(gen, impl, j):
    """Not merely close: the future enters no product a past output is rounded from."""
    w, n = 4, 17
    q, k, v, bases, pos_bias = _inputs(gen, n, w, 6, dtype=torch.float32)
    mask = _mask(n)
    out = ops.lavo_attention(q, k, v, bases, pos_bias, window=w, causal=True, key_padding_mask=mask, impl=impl)
    q2, k2, v2 = (torch.cat([t[:, :, :j], 1e3 * torch.randn_like(t[:, :, j:])], 2) for t in (q, k, v))
    out2 = ops.lavo_attention(q2, k2, v2, bases, pos_bias, window=w, causal=True, key_padding_mask=mask, impl=impl)
    assert torch.equal(out2[:, :, :j], out[:, :, :j])
    assert not torch.equal(out2[:, :, j:], out[:, :, j:])


@pytest.mark.parametrize("causal", [True, False])
def test_lavo_parallel_saves_half_inputs_not_float32_copies(gen, causal):
    """bf16 in: the op keeps q, k, v as given (upcast again in backward) and per-window sums, not fp32 copies."""
    q, k, v, bases, pos_bias = (t.bfloat16().requires_grad_() for t in _inputs(gen, 512, 16, 8, d=16))
    with saved_bytes() as held:
        out = ops.lavo_attention(q, k, v, bases, pos_bias, window=16, causal=causal, key_padding_mask=_mask(512),
                                 impl="parallel")
    assert out.dtype == torch.bfloat16
    assert held["bytes"] <= 1.3 * 3 * q.nbytes, held["bytes"] / q.nbytes
    out.float().sum().backward()
    assert q.grad.dtype == bases.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
def test_lavo_runs_on_the_meta_device(impl, causal):
    with torch.device("meta"):
        q, k, v = (torch.empty(2, 3, 37, 8, requires_grad=True) for _ in range(3))
        bases, pos_bias = torch.empty(3, 5, 8, requires_grad=True), torch.empty(3, 7, requires_grad=True)
        mask = torch.zeros(2, 37, dtype=torch.bool)
        out = ops.lavo_attention(q, k, v, bases, pos_bias, window=4, causal=causal, key_padding_mask=mask, impl=impl)
        out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and pos_bias.grad.shape == pos_bias.shape


@pytest.mark.extended  # compile handling: CI compiles one module case (tests/plugin/test_attention_compile.py)
@pytest.mark.parametrize("causal", [True, False])
def test_lavo_parallel_compiles_without_graph_breaks_and_equals_eager(gen, causal):
    """``compile_varying_lengths(op, fullgraph=True)``, as ``--attention-compile`` compiles: one graph (a break
    raises), its forward and the backward AOTAutograd compiles from the hand-written one give eager's values, two
    lengths (one dynamic graph)."""
    def op(q, k, v, bases, pos_bias, mask):
        return ops.lavo_attention(q, k, v, bases, pos_bias, window=4, causal=causal, key_padding_mask=mask,
                                  impl="parallel")

    compiled = compile_varying_lengths(op, fullgraph=True)
    for n in (23, 30):
        args = [t.float().requires_grad_() for t in _inputs(gen, n, 4, 6)]
        results = []
        for fn in (compiled, op):
            out = fn(*args, _mask(n))
            results.append([out, *torch.autograd.grad(out.square().sum(), args)])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture
def one_window_per_pass(monkeypatch):
    monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)


def _inputs_path(gen, b, h, n, d, w, r):
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    bases = ops.lavo_init_bases(h, r, d, dtype=torch.float64)
    pos_bias = 0.5 * torch.randn(h, 2 * w - 1, generator=gen, dtype=torch.float64)
    return q, k, v, bases, pos_bias


def _mask_path(b, n):
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, n - n // 3:] = True  # right padding
    mask[-1, : n // 4] = True  # left padding
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("n", [12, 14])
def test_lavo_in_many_passes_matches_reference(gen, one_window_per_pass, causal, padded, n):
    args = _inputs_path(gen, 2, 3, n, 4, 3, 2)
    mask = _mask_path(2, n) if padded else None
    out = ops.lavo_attention(*args, window=3, causal=causal, key_padding_mask=mask)
    ref = ops.lavo_attention_reference(*args, window=3, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_lavo_gradcheck_float64_in_many_passes(gen, one_window_per_pass, causal, padded):
    args = [t.requires_grad_() for t in _inputs_path(gen, 2, 2, 8, 3, 3, 2)]
    mask = _mask_path(2, 8) if padded else None
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
    q, k, v, bases, pos_bias = _inputs_path(gen, 2, 3, n, 4, 3, 2)
    qkv = helpers.fairseq_layout(q, k, v) if fairseq_layout else (q, k, v)
    args = [t.requires_grad_() for t in (*qkv, bases, pos_bias)]
    kw = dict(window=3, causal=causal, key_padding_mask=_mask_path(2, n) if padded else None)
    helpers.assert_same_values_and_grads(ops.lavo_attention(*args, **kw), ops.lavo_attention_reference(*args, **kw),
                                          args, gen)

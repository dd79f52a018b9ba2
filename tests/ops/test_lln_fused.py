"""LLN's fused implementation (``linattn/ops/lln/fused.py``, kernels in ``linattn/ops/triton/``) run by Triton's
interpreter on CPU tensors: forward and input gradients against the float64 reference (LLN eq. 8-9) within
``linattn/tolerances.py``, padding left and right, odd lengths, both causalities, fp16 and bf16, alpha != beta; the
causal leak test (exact); the meta device; one custom op each way per call, for the op counter and
``torch.compile``."""
import json
import os

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUTS, check_fused_layouts, compiled_op_count, padding_mask, rel_err

from linattn import ops
from linattn.ops.impls import ImplementationError, implementation_for
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before anything imports Triton"

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (common.py)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# of a family of cases that walk the same kernel paths (the other half dtype, side or layout), one or two stay in
# the default tier and their twins run in the extended one (docs/development.md)
EXTENDED = pytest.mark.extended
TWO_OF_FOUR = [("float16", "left"), ("bfloat16", "right"), *(pytest.param(*case, marks=EXTENDED)
                                                            for case in (("bfloat16", "left"), ("float16", "right")))]


def inputs(gen, dtype, n, b=2, h=2, d=20, dv=12, scale=1.0):
    """q, k (B,H,N,D), v (B,H,N,Dv) in ``dtype``, leaves that require grad; D and Dv not powers of two."""
    make = [torch.randn(b, h, n, w, generator=gen) * s for w, s in ((d, scale), (d, scale), (dv, 1.0))]
    return [t.to(dtype).requires_grad_() for t in make]


ALPHA = torch.tensor([1.3, 0.7]).view(1, 2, 1, 1)  # per head, and != beta
BETA = 0.9


def run(q, k, v, impl, *, causal, mask=None, chunk=8):
    return ops.lln_attention(q, k, v, ALPHA, BETA, causal=causal, key_padding_mask=mask, chunk_size=chunk, impl=impl)


def reference_with_grads(q, k, v, grad, *, causal, mask=None):
    """The float64 reference output and its gradients for q, k, v under dL/d(out) = grad."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ops.lln_attention_reference(*leaves, ALPHA, BETA, causal=causal, key_padding_mask=mask)
    return ref, torch.autograd.grad(ref, leaves, grad.double())


def check_against_reference(gen, q, k, v, dtype, *, causal, mask, chunk=8):
    out = run(q, k, v, "fused", causal=causal, mask=mask, chunk=chunk)
    grad = torch.randn(out.shape, generator=gen)
    ref, want = reference_with_grads(q, k, v, grad, causal=causal, mask=mask)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tolerance("lln", dtype)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)), want):
        assert g.dtype == q.dtype
        assert rel_err(g, w) < tolerance("lln", dtype, gradient=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, side", [(3, "right"), (7, "left"), (19, "right"), (19, "left")])
def test_fused_matches_the_float64_reference_with_gradients(gen, dtype, causal, n, side):
    q, k, v = inputs(gen, DTYPES[dtype], n)
    mask = padding_mask(2, n, side, gen)
    assert implementation_for("lln", "fused", q, v) == "fused"
    check_against_reference(gen, q, k, v, dtype, causal=causal, mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_with_whole_chunks_of_padding(gen, causal):
    q, k, v = inputs(gen, torch.float16, 19)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, :17] = True  # the first two chunks of the second sequence hold no key
    check_against_reference(gen, q, k, v, "float16", causal=causal, mask=mask)


@pytest.mark.parametrize("dtype, causal", [("float16", True), ("bfloat16", False),
                                           *(pytest.param(*case, marks=EXTENDED)
                                             for case in (("bfloat16", True), ("float16", False)))])
def test_fused_with_exact_fp32_products_matches_the_reference(gen, monkeypatch, dtype, causal):
    """``TF32`` (``triton/common.LAUNCH``): the unbounded operands' products are rounded to tf32 by default (under
    the interpreter as the tensor cores round them, so every other test checks that rounding); with TF32 false
    (exact fp32 FMA products, a tuning choice) the op also stays within the tolerances, and the default's rounding
    is applied: the output or a gradient differs from the exact products'."""
    from linattn.ops.triton.common import LAUNCH

    q, k, v = inputs(gen, DTYPES[dtype], 19)
    mask = padding_mask(2, 19, "left", gen)
    grad = torch.randn(2, 2, 19, 12, generator=gen).to(DTYPES[dtype])

    def values():
        out = run(q, k, v, "fused", causal=causal, mask=mask)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    tf32 = values()
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({name: {"TF32": False} for name, settings in LAUNCH.items()
                                                            if "TF32" in settings}))
    check_against_reference(gen, q, k, v, dtype, causal=causal, mask=mask)
    assert any(not torch.equal(a, b) for a, b in zip(values(), tf32))


@pytest.mark.parametrize("bv, split", [(None, None), (16, None), (None, 2)])
@pytest.mark.parametrize("side", ["left", "right", None])
def test_causal_fused_shifts_are_the_parallel_forms_exactly(gen, monkeypatch, bv, side, split):
    """The running key maxima the causal walk keeps (m_prev, m_incl, which its outputs and gradients use) equal the
    parallel form's, bit for bit: D = 20 in feature blocks of 16 (the last partial), value columns whole or in blocks
    of 16, a chunk wholly padded on the left (0 before any key) or a padded tail, and keys on both signs and scales
    (a maximum taken over the wrong chunks, features, or padded keys shows); the 5 chunks walked whole or in segments
    of 2 (``common.walk_grid``: the last one partial, each segment's maximum carried into the later ones; on the
    left the second sequence's first segment all padding)."""
    from linattn.ops.lln import fused, parallel
    from linattn.ops.lln.inputs import lln_inputs

    walk = {"BV": bv} if bv else {}
    if split:
        walk["SPLIT"] = split
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": walk}))
    q, k, v = (t.detach() for t in inputs(gen, torch.float16, 37, dv=40))
    k = k * torch.linspace(-3, 5, 20).half()  # per-feature scales, some features negative throughout
    mask = None if side is None else torch.zeros(2, 37, dtype=torch.bool)
    if side == "left":
        mask[0, :11] = True  # chunk 0 (8 rows) wholly padded, chunk 1 partly
        mask[1, :19] = True  # chunks 0 and 1 wholly padded, chunk 2 partly
    elif side == "right":
        mask[1, 30:] = True
    x = lln_inputs(q, k, v, ALPHA, BETA, mask, causal=True, chunk_size=8, upcast=False)
    _, (_, m_incl, m_prev, *_) = fused.forward(x)
    _, _, want_incl, want_prev = parallel._causal_shifts(x)
    assert torch.equal(m_incl, want_incl) and torch.equal(m_prev, want_prev)
    if side == "left":
        assert (m_incl[0, :, :, 0] == 0).all() and (m_prev[:, :, :, 0] == 0).all()
        assert (m_incl[1, :, :, :2] == 0).all() and (m_prev[1, :, :, :3] == 0).all()


@pytest.mark.parametrize("side", ["left", "right", None])
def test_noncausal_fused_shift_is_the_parallel_forms_exactly(gen, monkeypatch, side):
    """The per-feature key maximum m (which the output and the gradients use) over 3 splits of 16 keys, each split's
    program taking it over every split's maximum: equal to the parallel form's bit for bit, a sequence whose first
    split is all padding (left) or whose keys are all padding (0, as no key), D = 20."""
    from linattn.ops.lln import fused, parallel
    from linattn.ops.lln.inputs import lln_inputs
    from linattn.ops.triton import lln_noncausal

    monkeypatch.setattr(lln_noncausal, "ROWS", 16)
    monkeypatch.setattr(lln_noncausal, "SPLIT_ROWS", 16)
    q, k, v = (t.detach() for t in inputs(gen, torch.float16, 37, b=3))
    k = k * torch.linspace(-3, 5, 20).half()
    mask = None if side is None else torch.zeros(3, 37, dtype=torch.bool)
    if side == "left":
        mask[0, :20], mask[2] = True, True
    elif side == "right":
        mask[1, 3:] = True  # the last two splits' keys padded, the maximum is the first split's
    x = lln_inputs(q, k, v, ALPHA, BETA, mask, causal=False, chunk_size=8, upcast=False)
    _, (_, m, *_) = fused.forward(x)
    want = parallel._noncausal_features(x)[2]
    assert torch.equal(m, want)
    if side == "left":
        assert (m[2] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_fused_shifts_ignore_what_padded_keys_hold(gen, causal, side):
    """The key maxima that shift the features leave padded keys out: padded keys near fp16's largest value (whose
    beta k would make every real key's feature underflow to 0) change no output or gradient."""
    q, k, v = inputs(gen, torch.float16, 19)
    mask = padding_mask(2, 19, side, gen)
    with torch.no_grad():
        k.masked_fill_(mask[:, None, :, None], 6.0e4)
    check_against_reference(gen, q, k, v, "float16", causal=causal, mask=mask)


@pytest.mark.parametrize("causal, layouts", [
    (causal, layouts) if (causal, i) in ((False, 1), (True, 3)) else pytest.param(causal, layouts, marks=EXTENDED)
    for causal in (False, True) for i, layouts in enumerate(LAYOUT_CASES)])
def test_fused_reads_fairseqs_layout_in_place_and_answers_in_it(gen, causal, layouts):
    """q, k, v and dL/d(out) in fairseq's layout ((N,B,H,X) viewed (B,H,N,X), as the module's head split gives
    them), contiguous, or another: the contiguous run's output and gradients, bit for bit, in the inputs' layouts
    where the kernels read them in place (``helpers.check_fused_layouts``)."""
    q, k, v = inputs(gen, torch.float16, 11)
    mask = padding_mask(2, 11, "left", gen)
    grad = torch.randn(2, 2, 11, 12, generator=gen).half()
    check_fused_layouts(lambda *qkv: run(*qkv, "fused", causal=causal, mask=mask), (q, k, v), grad, layouts)


@pytest.mark.parametrize("layout", ["contiguous", "fairseq"])
def test_noncausal_fused_cross_attention_matches_the_reference(gen, layout):
    """13 queries against 19 keys and values (padded on the left), contiguous or in fairseq's layout: the keys' rows
    are laid out by their own length, not the queries'."""
    q = inputs(gen, torch.float16, 13)[0]
    k, v = inputs(gen, torch.float16, 19)[1:]
    mask = padding_mask(2, 19, "left", gen)
    q, k, v = (LAYOUTS[layout](t.detach())[0].requires_grad_() for t in (q, k, v))
    check_against_reference(gen, q, k, v, "float16", causal=False, mask=mask)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=EXTENDED)])
def test_causal_fused_outputs_depend_on_no_future_token_exactly(gen, dtype):
    q, k, v = (t.detach() for t in inputs(gen, DTYPES[dtype], 21, scale=2.0))
    out = run(q, k, v, "fused", causal=True)
    for t in (4, 8, 13):  # the first row of a chunk, the last of one, a middle one
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1:] *= 10
        changed = run(q2, k2, v2, "fused", causal=True)
        assert torch.equal(changed[:, :, :t + 1], out[:, :, :t + 1])


@pytest.mark.parametrize("dtype", [pytest.param("float16", marks=EXTENDED), "bfloat16"])
def test_causal_fused_ignores_an_extreme_future_key_exactly(gen, dtype):
    """A later key at beta k = 0.9 * 90 = 81 on every feature (exp's fp32 range ends at 88) changes no earlier
    output, bit for bit: the key maxima and shifts are taken over earlier chunks only."""
    q, k, v = (t.detach() for t in inputs(gen, DTYPES[dtype], 21, scale=2.0))
    out = run(q, k, v, "fused", causal=True)
    for t in (3, 8, 15):  # a chunk's middle, its first row, its last
        k2 = k.clone()
        k2[:, :, t] = 90.0
        changed = run(q, k2, v, "fused", causal=True)
        assert torch.equal(changed[:, :, :t], out[:, :, :t]) and changed[:, :, t:].isfinite().all()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the causal form's known limit (tests/ops/test_lln.py), "
                   "no worse fused: its shifts underflow when |alpha q|, |beta k| >~ 35 sit on different channels")
def test_causal_fused_misaligned_extreme_features_match_reference():
    q, k = torch.tensor([[[[5.0, -5.0]]]]).half(), torch.tensor([[[[-5.0, 5.0]]]]).half()
    v = torch.tensor([[[[1.0, 2.0]]]]).half()
    assert implementation_for("lln", "fused", q, v) == "fused"
    torch.testing.assert_close(ops.lln_attention(q, k, v, 8.0, 8.0, causal=False, impl="fused"), v)
    torch.testing.assert_close(ops.lln_attention(q, k, v, 8.0, 8.0, causal=True, impl="fused"), v)


def test_fp32_asked_for_fused_is_refused_naming_why():
    q = torch.randn(1, 2, 9, 8)
    with pytest.raises(ImplementationError, match=r"dtype torch.float32 not in \(float16, bfloat16\)"):
        implementation_for("lln", "fused", q)
    with pytest.raises(ImplementationError, match=r"dtype torch.float32 not in \(float16, bfloat16\)"):
        run(q, q, q, "fused", causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_runs_on_the_meta_device_forward_and_backward(causal):
    q, k, v = (torch.empty(2, 2, 37, d, dtype=torch.float16, device="meta", requires_grad=True) for d in (20, 20, 12))
    assert implementation_for("lln", "fused", q, v) == "fused"
    out = run(q, k, v, "fused", causal=causal, mask=torch.zeros(2, 37, dtype=torch.bool, device="meta"))
    assert out.shape == (2, 2, 37, 12) and out.dtype == torch.float16
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("dtype, causal", [("bfloat16", True), ("float16", False),
                                           *(pytest.param(*case, marks=EXTENDED)
                                             for case in (("float16", True), ("bfloat16", False)))])
def test_averaged_forward_keeps_its_output_rounded_by_the_kernel(gen, dtype, causal):
    """LLN+Diag's LLN part (``averaged``): the fp32 output the block kernel averages into, and the same output in the
    half dtype, stored by the same kernel, that the backward keeps: exactly the fp32 one rounded (no conversion op
    after the kernel); without ``averaged`` the op's output is already half and nothing more is written."""
    from linattn.ops.lln import fused
    from linattn.ops.lln.inputs import lln_inputs

    q, k, v = (t.detach() for t in inputs(gen, DTYPES[dtype], 21))
    x = lln_inputs(q, k, v, ALPHA, BETA, padding_mask(2, 21, "left", gen), causal=causal, chunk_size=8, upcast=False)
    with count_dispatch() as counts:
        out, (kept, *_) = fused.forward(x, averaged=True)
    assert out.dtype == torch.float32 and kept.dtype == DTYPES[dtype] and counts.ops["_to_copy"] == 0
    assert kept.stride() == out.stride()
    if dtype == "float16":
        assert torch.equal(kept, out.to(kept.dtype))
    else:  # Triton's interpreter truncates a bfloat16 store (a GPU rounds it to nearest): within one ulp
        torch.testing.assert_close(kept.float(), out, rtol=2**-7, atol=0)
    plain, (same, *_) = fused.forward(x)
    assert plain is same and torch.equal(plain, kept)


@pytest.mark.parametrize("causal", [False, True])
def test_one_custom_op_each_way_and_a_fixed_op_count(gen, causal):
    name = "lln_causal" if causal else "lln_noncausal"
    counts = []
    for n in (16, 64):
        q, k, v = inputs(gen, torch.float16, n, b=1)
        with count_dispatch() as c:
            run(q, k, v, "fused", causal=causal).sum().backward()
        assert c.ops[name] == 1 and c.ops[name + "_backward"] == 1
        counts.append(c.launched)
    assert counts[0] == counts[1]


@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph_sees_one_custom_op(gen, causal):
    q, k, v = (t.detach() for t in inputs(gen, torch.bfloat16, 19, b=1))
    name = "lln_causal" if causal else "lln_noncausal"
    assert compiled_op_count(lambda q, k, v: run(q, k, v, "fused", causal=causal), (q, k, v), name) == 1


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_at_a_larger_shape_matches_the_reference(gen, dtype, causal):
    q, k, v = inputs(gen, DTYPES[dtype], 200, d=64, dv=64, scale=1.5)
    check_against_reference(gen, q, k, v, dtype, causal=causal, mask=padding_mask(2, 200, "right", gen), chunk=64)


@pytest.mark.parametrize("dtype, side", TWO_OF_FOUR)
def test_noncausal_fused_with_wide_heads_matches_the_reference(gen, dtype, side):
    """D = 72, Dv = 80: blocks of 128, at ``LAUNCH_128``'s settings: the readout's programs take 32 value columns
    each (three, the last partial), the backward's take dq's features, or dk's and dv's, 64 at a time."""
    q, k, v = inputs(gen, DTYPES[dtype], 19, d=72, dv=80)
    check_against_reference(gen, q, k, v, dtype, causal=False, mask=padding_mask(2, 19, side, gen))


@pytest.mark.parametrize("side, split_rows", [("left", 16), ("right", 32), pytest.param("right", 16, marks=EXTENDED),
                                              pytest.param("left", 32, marks=EXTENDED)])
def test_noncausal_fused_over_several_splits(gen, monkeypatch, side, split_rows):
    """The non-causal kernels' reductions split over the rows (``_state``'s keys, ``_state_grad``'s queries), each
    split's partial [S, z] summed after: at N = 50, 4 splits of one step or 2 of two steps (ROWS = 16), the last one
    partial; the second sequence padded on the left over 37 keys (whole splits of padding) or on the right over 13."""
    from linattn.ops.triton import lln_noncausal
    monkeypatch.setattr(lln_noncausal, "ROWS", 16)  # both read at call time, by the forward and the backward
    monkeypatch.setattr(lln_noncausal, "SPLIT_ROWS", split_rows)
    q, k, v = inputs(gen, torch.float16, 50)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[1, :37] = side == "left"
    mask[1, 37:] = side == "right"
    check_against_reference(gen, q, k, v, "float16", causal=False, mask=mask)

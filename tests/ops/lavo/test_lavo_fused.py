"""LAVO's fused implementation (``linattn/ops/lavo/fused.py``, kernels ``linattn/ops/triton/lavo*.py``) run by Triton's
interpreter on CPU tensors: forward and the gradients of q, k, v, the bases and the relative bias against the float64
reference (docs/design.md §6, materialised) within ``linattn/tolerances.py``, both causalities, padding left and right
(whole windows of it: queries with no key), odd and tiny lengths, windows not a power of two, random (not
orthogonal) bases with r < D, fp16 and bf16; the causal leak test (exact); padded rows' contents reach nothing; a
sequence's output independent of its batch; the memory gradient over several splits; tf32 products; the meta
device; one custom op each way, for the op counter and ``torch.compile``."""
import json

import pytest
import torch
from helpers import LAYOUT_CASES, check_fused_layouts, compiled_op_count, padding_mask, rel_err, siblings_layout

from linattn import ops
from linattn.ops.impls import ImplementationError, implementation_for
from linattn.ops.real_tokens import over_reordered_tokens, real_first_order
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def inputs(gen, dtype, n, b=2, h=2, d=12, r=6, w=4):
    """q, k, v (B,H,N,D), random bases (H,r,D) in ``dtype`` and a relative bias (H,2w-1) fp32: leaves."""
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for _ in range(3))
    bases = (torch.randn(h, r, d, generator=gen) * 0.4).to(dtype)
    pos_bias = torch.randn(h, 2 * w - 1, generator=gen) * 0.5
    return [t.requires_grad_() for t in (q, k, v, bases, pos_bias)]


def run(q, k, v, bases, pos_bias, impl, *, causal, mask=None):
    w = (pos_bias.shape[1] + 1) // 2
    return ops.lavo_attention(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl)


def check_against_reference(gen, leaves, dtype, *, causal, mask):
    out = run(*leaves, "fused", causal=causal, mask=mask)
    grad = torch.randn(out.shape, generator=gen)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    w = (leaves[4].shape[1] + 1) // 2
    ref = ops.lavo_attention_reference(*wide, window=w, causal=causal, key_padding_mask=mask)
    want = torch.autograd.grad(ref, wide, grad.double())
    assert out.dtype == leaves[0].dtype and rel_err(out, ref) < tolerance("lavo", dtype)
    for x, g, ww in zip(leaves, torch.autograd.grad(out, leaves, grad.to(out.dtype)), want):
        assert g.dtype == x.dtype and rel_err(g, ww) < tolerance("lavo", dtype, gradient=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, side, w", [(1, None, 4), (19, "right", 4), (19, "whole-left", 4), (17, "left", 3)])
def test_fused_matches_the_float64_reference_with_gradients(gen, dtype, causal, n, side, w):
    """whole-left: the second sequence's first 9 tokens padded, so its first two windows hold no key."""
    leaves = inputs(gen, DTYPES[dtype], n, w=w)
    mask = None
    if side == "whole-left":
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, :9] = True
    elif side:
        mask = padding_mask(2, n, side, gen)
    assert implementation_for("lavo", "fused", leaves[0], leaves[2], window=w) == "fused"
    check_against_reference(gen, leaves, dtype, causal=causal, mask=mask)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.extended)])
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_fused_at_a_head_size_of_blocks_of_128_matches_the_reference(gen, dtype, causal):
    """D = 72 (blocks of 128: ``LAUNCH_128``'s settings) and w = 20 (a window block of 32): the products' steps over
    D's columns (BK), the steps over a window's rows (BLOCK) and the key gradients' column programs (COLS), the last
    of each partly outside D; causal fp16 here, the non-causal build and bf16 in the extended tier (7-20 s each
    under the interpreter)."""
    leaves = inputs(gen, DTYPES[dtype], 45, d=72, r=8, w=20)
    check_against_reference(gen, leaves, dtype, causal=causal, mask=padding_mask(2, 45, "left", gen))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layouts", LAYOUT_CASES)
def test_fused_reads_fairseqs_layout_in_place_and_answers_in_it(gen, causal, layouts):
    """q, k, v and dL/d(out) in fairseq's layout, contiguous or another: the contiguous run's output and gradients,
    bit for bit, in the inputs' layouts where the kernels read them in place (``helpers.check_fused_layouts``)."""
    q, k, v, bases, pos_bias = inputs(gen, torch.float16, 11)
    mask = padding_mask(2, 11, "right", gen)
    grad = torch.randn(2, 2, 11, 12, generator=gen).half()
    check_fused_layouts(lambda *qkv: run(*qkv, bases, pos_bias, "fused", causal=causal, mask=mask), (q, k, v), grad,
                        layouts)


@pytest.mark.parametrize("causal, side, layout", [  # one case a causality and a layout here, their twins extended
    (True, "left", "contiguous"), (False, "whole-left", "siblings"),
    pytest.param(False, "left", "contiguous", marks=pytest.mark.extended),
    pytest.param(True, "whole-left", "siblings", marks=pytest.mark.extended)])
def test_real_first_kernels_read_through_the_order_as_the_gathered_rows(gen, causal, side, layout):
    """``real_first`` (the module's): the kernels read and write each row through its real-first order, and give the
    output and the gradients (bases and bias too) of the same kernels over q, k, v gathered in that order and put
    back, bit for bit, with q, k, v contiguous (fp16) or packed as the module packs them (read in place; bf16, whole
    windows of padding first); padded tokens then count no position (not the plain op's output)."""
    q, k, v, bases, pos_bias = inputs(gen, torch.bfloat16 if side == "whole-left" else torch.float16, 19)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, :9] = True  # whole windows of padding first
    mask = mask if side == "whole-left" else padding_mask(2, 19, side, gen)
    leaves = (q, k, v) if layout == "contiguous" else siblings_layout(*(t.detach() for t in (q, k, v)))
    leaves = [t.detach().requires_grad_() for t in leaves] + [bases, pos_bias]
    grad = torch.randn(2, 2, 19, 12, generator=gen).to(q.dtype)
    w = (pos_bias.shape[1] + 1) // 2

    def lavo(*args, real_first, impl="fused", mask=mask):
        return ops.lavo_attention(*args, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl,
                                  real_first=real_first)

    def gathered(q, k, v, reordered_mask):
        return lavo(q, k, v, real_first=False, mask=reordered_mask)

    results = []
    for out in (lavo(*leaves[:3], real_first=True), over_reordered_tokens(gathered, *leaves[:3],
                                                                          *real_first_order(mask))):
        results.append([out, *torch.autograd.grad(out, leaves, grad)])
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert not torch.equal(results[0][0], lavo(*leaves[:3], real_first=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_fused_outputs_depend_on_no_future_token_exactly(gen, dtype):
    q, k, v, bases, pos_bias = (t.detach() for t in inputs(gen, DTYPES[dtype], 23))
    out = run(q, k, v, bases, pos_bias, "fused", causal=True)
    for t in (2, 4, 9, 16):  # inside the first window, the first row of one, middles of later ones
        changed = [x.clone() for x in (q, k, v)]
        for x in changed:
            x[:, :, t:] *= 10
        assert torch.equal(run(*changed, bases, pos_bias, "fused", causal=True)[:, :, :t], out[:, :, :t])


@pytest.mark.parametrize("causal, side", [  # each causality and each side here, their twins extended
    (True, "left"), (False, "right"), pytest.param(True, "right", marks=pytest.mark.extended),
    pytest.param(False, "left", marks=pytest.mark.extended)])
def test_padded_rows_reach_nothing_whatever_they_hold(gen, causal, side):
    """Padded keys are never seen and padded tokens stay out of the memory: 6e4 in their q and k and inf in their v
    change no real row's output and, with no gradient on the padded rows (as downstream gives), no gradient of a real
    row, of the bases or of the bias, bit for bit."""
    q, k, v, bases, pos_bias = (t.detach() for t in inputs(gen, torch.float16, 14))
    mask = padding_mask(2, 14, side, gen)
    rows = mask[:, None, :, None]
    grad = torch.randn(2, 2, 14, 12, generator=gen).to(torch.float16).masked_fill(rows, 0.0)
    results = []
    for fills in ((0.0, 0.0, 0.0), (6e4, -6e4, float("inf"))):
        held = [t.masked_fill(rows, f).requires_grad_() for t, f in zip((q, k, v), fills)]
        params = [bases.clone().requires_grad_(), pos_bias.clone().requires_grad_()]
        out = run(*held, *params, "fused", causal=causal, mask=mask)
        grads = torch.autograd.grad(out, held + params, grad)
        results.append([out.masked_fill(rows, 0.0), *(g.masked_fill(rows, 0.0) for g in grads[:3]), *grads[3:]])
    for got, want in zip(*results):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_a_sequence_output_does_not_depend_on_its_batch(gen, causal):
    q, k, v, bases, pos_bias = (t.detach() for t in inputs(gen, torch.bfloat16, 13, b=3))
    mask = padding_mask(3, 13, "left", gen)
    grad = torch.randn(3, 2, 13, 12, generator=gen).to(torch.bfloat16)

    def values(i):
        leaves = [t[i].requires_grad_() for t in (q, k, v)]
        out = run(*leaves, bases, pos_bias, "fused", causal=causal, mask=mask[i])
        return [out, *torch.autograd.grad(out, leaves, grad[i])]

    for got, want in zip(values(slice(1, 2)), values(slice(None))):
        assert torch.equal(got, want[1:2])


@pytest.mark.parametrize("causal", [True, False])
def test_memory_gradient_over_several_splits(gen, monkeypatch, causal):
    """dL/dB summed over splits of 2 windows (9 windows: 5 splits, the last one partial)."""
    from linattn.ops.triton import lavo_backward
    monkeypatch.setattr(lavo_backward, "SPLIT_WINDOWS", 2)
    check_against_reference(gen, inputs(gen, torch.float16, 34), "float16", causal=causal,
                            mask=padding_mask(2, 34, "right", gen))


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_fused_with_exact_fp32_products_matches_the_reference(gen, monkeypatch, causal):
    """``TF32``: the unbounded operands' products are rounded to tf32 by default; with TF32 false (exact fp32 FMA
    products, a tuning choice) the op also stays within the tolerances, and the default's rounding is applied."""
    leaves = inputs(gen, torch.float16, 13)
    mask = padding_mask(2, 13, "left", gen)
    grad = torch.randn(2, 2, 13, 12, generator=gen).to(torch.float16)

    def values():
        out = run(*leaves, "fused", causal=causal, mask=mask)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    tf32 = values()
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({name: {"TF32": False} for name in (
        "lavo_memory", "lavo_memory_grad", "lavo_bases_grad", "lavo_local_query_grad", "lavo_local_grad")}))
    check_against_reference(gen, leaves, "float16", causal=causal, mask=mask)
    changed = [not torch.equal(a, b) for a, b in zip(values(), tf32)]
    assert changed == [True, True, True, False, True, False]  # dv and the bias' gradient take no such product


def test_what_the_kernels_cannot_take_is_refused_naming_why(gen):
    q = torch.randn(1, 2, 9, 8, dtype=torch.float16)
    assert implementation_for("lavo", "fused", q, window=64, bases_dtype=torch.float16) == "fused"
    for options, why in ((dict(window=65), "window 65 > 64"),  # its (w, 2w) scores in registers
                         (dict(bases_dtype=torch.float32), "bases' dtype torch.float32 is not the queries'")):
        with pytest.raises(ImplementationError, match=why):
            implementation_for("lavo", "fused", q, **options)
    q, k, v, bases, pos_bias = (t.detach().float() for t in inputs(gen, torch.float16, 9))
    with pytest.raises(ImplementationError, match=r"dtype torch.float32 not in \(float16, bfloat16\)"):
        run(q, k, v, bases, pos_bias, "fused", causal=True)  # fp32: half inputs only


@pytest.mark.parametrize("causal", [True, False])
def test_fused_runs_on_the_meta_device_forward_and_backward(causal):
    q, k, v = (torch.empty(2, 2, 37, 12, dtype=torch.float16, device="meta", requires_grad=True) for _ in range(3))
    bases = torch.empty(2, 6, 12, dtype=torch.float16, device="meta", requires_grad=True)
    pos_bias = torch.empty(2, 7, device="meta", requires_grad=True)
    out = run(q, k, v, bases, pos_bias, "fused", causal=causal, mask=torch.zeros(2, 37, dtype=torch.bool,
                                                                                  device="meta"))
    assert out.shape == (2, 2, 37, 12) and out.dtype == torch.float16
    out.sum().backward()
    assert q.grad.shape == q.shape and bases.grad.shape == bases.shape and pos_bias.grad.shape == pos_bias.shape


@pytest.mark.parametrize("causal", [True, False])
def test_one_custom_op_each_way_and_a_fixed_op_count(gen, causal):
    counts = []
    for n in (8, 32):
        leaves = inputs(gen, torch.float16, n, b=1)
        with count_dispatch() as c:
            run(*leaves, "fused", causal=causal).sum().backward()
        assert c.ops["lavo"] == 1 and c.ops["lavo_backward"] == 1
        counts.append(c.launched)
    assert counts[0] == counts[1]


def test_compile_fullgraph_sees_one_custom_op(gen):
    q, k, v, bases, pos_bias = (t.detach() for t in inputs(gen, torch.bfloat16, 19, b=1))
    fn = lambda q, k, v: run(q, k, v, bases, pos_bias, "fused", causal=True)  # noqa: E731
    assert compiled_op_count(fn, (q, k, v), "lavo") == 1


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_at_a_larger_shape_matches_the_reference(gen, dtype, causal):
    leaves = inputs(gen, DTYPES[dtype], 300, d=64, r=64, w=64)
    check_against_reference(gen, leaves, dtype, causal=causal, mask=padding_mask(2, 300, "right", gen))

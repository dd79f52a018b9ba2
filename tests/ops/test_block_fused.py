"""Block softmax's and LLN+Diag's fused implementations (``block_softmax/fused.py``, ``lln_diag/fused.py``; kernel
``linattn/ops/triton/block_softmax.py``) run by Triton's interpreter on CPU tensors: forward and input gradients
against the float64 references within ``linattn/tolerances.py`` (the softmax's row for the block part), blocks of 8
with a shorter last one, padding left and right (whole blocks of it: rows that see no key give 0), both
causalities, fp16 and bf16; the causal leak test; the meta device; one custom op each way."""
import helpers
import pytest
import torch
from helpers import LAYOUT_CASES, check_fused_layouts, compiled_op_count, padding_mask, rel_err

from linattn import ops
from linattn.ops.impls import implementation_for
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ALPHA = torch.tensor([1.3, 0.7]).view(1, 2, 1, 1)  # per head, and != beta
BETA = 0.9


def inputs(gen, dtype, n, d=20, dv=12):
    return [(torch.randn(2, 2, n, w, generator=gen)).to(dtype).requires_grad_() for w in (d, d, dv)]


def block(q, k, v, impl, *, causal, mask):
    return ops.block_softmax_attention(q, k, v, block_size=8, causal=causal, key_padding_mask=mask, impl=impl)


def lln_diag(q, k, v, impl, *, causal, mask):
    return ops.lln_diag_attention(q, k, v, ALPHA, BETA, block_size=8, chunk_size=8, causal=causal,
                                  key_padding_mask=mask, impl=impl)


def references(q, k, v, *, causal, mask):
    return {"block": lambda *t: ops.block_softmax_attention_reference(*t, block_size=8, causal=causal,
                                                                     key_padding_mask=mask),
            "lln_diag": lambda *t: ops.lln_diag_attention_reference(*t, ALPHA, BETA, block_size=8, causal=causal,
                                                                   key_padding_mask=mask)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, side", [(5, "right"), (19, "left"), (19, "right")])
@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_fused_matches_the_float64_reference_with_gradients(gen, op, dtype, causal, n, side):
    q, k, v = inputs(gen, DTYPES[dtype], n)
    mask = padding_mask(2, n, side, gen)
    if n == 19:
        mask[1] = torch.arange(n) < 11 if side == "left" else torch.arange(n) >= 5  # whole blocks of padding
    check_against_references(gen, op, dtype, q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("op, dtype, causal", [("lln_diag", "float16", False), *(
    pytest.param(*case, marks=pytest.mark.extended) for case in (("block", "bfloat16", True),
                                                                 ("lln_diag", "bfloat16", False)))])
def test_fused_with_wide_heads_matches_the_float64_reference(gen, op, dtype, causal):
    """D = 72, Dv = 80: blocks of 128, at ``LAUNCH_128``'s settings: the backward's programs split a block's features
    and value columns in two (64 each, the second partial), LLN's kernels (LLN+Diag) theirs too."""
    q, k, v = inputs(gen, DTYPES[dtype], 19, d=72, dv=80)
    check_against_references(gen, op, dtype, q, k, v, causal=causal, mask=padding_mask(2, 19, "left", gen))


@pytest.mark.parametrize("mix", ["learnable_scale", "learnable_ratio"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_fused_learnable_mixes_match_the_float64_reference_with_gradients(gen, mix, causal, side):
    """LLN+Diag's learnable mixes run fused as two ops, LLN's and the block softmax's, mixed by r, p (H, Dv) of
    different values: the output and the gradients of q, k, v, r and p against the float64 reference's, a row with
    whole blocks of padding. Non-causal, the rows are gathered into no real-first order (its block kernels read them
    through it, and LLN's non-causal part does not depend on it); causal, they are."""
    q, k, v = inputs(gen, torch.float16, 19)
    mask = padding_mask(2, 19, side, gen)
    mask[1] = torch.arange(19) < 11 if side == "left" else torch.arange(19) >= 5
    r, p = (torch.rand(2, 12, generator=gen) + lo for lo in (0.2, 0.6))
    weights = [w.requires_grad_() for w in (r, p)]
    kw = dict(block_size=8, chunk_size=8, causal=causal, key_padding_mask=mask, mix=mix)
    with count_dispatch() as counts:
        out = ops.lln_diag_attention(q, k, v, ALPHA, BETA, **kw, r=r, p=p, impl="fused")
    assert (counts.ops["gather"] > 0) == causal
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, r, p)]
    ref = ops.lln_diag_attention_reference(*leaves[:3], ALPHA, BETA, **kw, r=leaves[3], p=leaves[4])
    grad = torch.randn(out.shape, generator=gen)
    want = torch.autograd.grad(ref, leaves[:3] + leaves[3:(5 if mix == "learnable_scale" else 4)], grad.double())
    got = torch.autograd.grad(out, (q, k, v, *weights[:len(want) - 3]), grad.half())
    assert out.dtype == torch.float16 and rel_err(out, ref) < tolerance("lln_diag", "float16")
    for g, w in zip(got, want):
        assert rel_err(g, w) < tolerance("lln_diag", "float16", gradient=True)


def check_against_references(gen, op, dtype, q, k, v, *, causal, mask):
    """The fused op's output and gradients against the float64 reference's, within ``linattn/tolerances.py``."""
    fn = block if op == "block" else lln_diag
    out = fn(q, k, v, "fused", causal=causal, mask=mask)
    grad = torch.randn(out.shape, generator=gen)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = references(q, k, v, causal=causal, mask=mask)[op](*leaves)
    want = torch.autograd.grad(ref, leaves, grad.double())
    method = "softmax" if op == "block" else "lln_diag"
    assert out.dtype == q.dtype and rel_err(out, ref) < tolerance(method, dtype)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)), want):
        assert g.dtype == q.dtype and rel_err(g, w) < tolerance(method, dtype, gradient=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layouts", LAYOUT_CASES)
@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_fused_reads_fairseqs_layout_in_place_and_answers_in_it(gen, op, causal, layouts):
    """q, k, v and dL/d(out) in fairseq's layout, contiguous or another: the contiguous run's output and gradients,
    bit for bit, in the inputs' layouts where the kernels read them in place (``helpers.check_fused_layouts``);
    LLN+Diag's block backward adds LLN's gradients in the kernel. (Causal LLN+Diag with a mask gathers q, k, v in
    each row's real-first order, in fairseq's layout: its kernels are read in place here without one.)"""
    q, k, v = inputs(gen, torch.float16, 11)
    mask = None if op == "lln_diag" and causal else padding_mask(2, 11, "right", gen)
    grad = torch.randn(2, 2, 11, 12, generator=gen).half()
    fn = block if op == "block" else lln_diag
    check_fused_layouts(lambda *qkv: fn(*qkv, "fused", causal=causal, mask=mask), (q, k, v), grad, layouts)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", [(5, 0), (3, 6)])
@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_fused_blocks_count_each_rows_real_tokens(gen, op, left, right, causal):
    """The kernels read and write a padded row's tokens through its real-first order: its real tokens' outputs and
    gradients are the row's alone, bit for bit for the block softmax (the same tiles; LLN's chunks shift with the
    padding, so LLN+Diag within its fp16 tolerance)."""
    fn = block if op == "block" else lln_diag
    fused = lambda *t, causal, mask: fn(*t, "fused", causal=causal, mask=mask)  # noqa: E731
    alone, padded = helpers.padded_row_against_alone(fused, gen, 19, left, right, causal, torch.float16)
    for a, b in zip(alone, padded):
        if op == "block":
            assert torch.equal(b, a)
        else:
            assert rel_err(b, a) < tolerance("lln_diag", "float16")


def test_fused_block_rows_that_see_no_key_give_zero(gen):
    q, k, v = inputs(gen, torch.float16, 19)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, 8:] = True  # the second sequence's real tokens fill its first block: its other blocks hold no key
    out = block(q, k, v, "fused", causal=False, mask=mask)
    assert torch.equal(out[1, :, 8:], torch.zeros_like(out[1, :, 8:])) and out[0].abs().sum() > 0


@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_causal_fused_outputs_depend_on_no_future_token_exactly(gen, op):
    q, k, v = (t.detach() for t in inputs(gen, torch.bfloat16, 21))
    fn = block if op == "block" else lln_diag
    out = fn(q, k, v, "fused", causal=True, mask=None)
    for t in (4, 8, 13):  # the middle of a block, the first row of one, another middle
        changed = [x.clone() for x in (q, k, v)]
        for x in changed:
            x[:, :, t:] *= 10
        assert torch.equal(fn(*changed, "fused", causal=True, mask=None)[:, :, :t], out[:, :, :t])


@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_fused_runs_on_the_meta_device_in_one_custom_op_each_way(gen, op):
    q, k, v = (torch.empty(2, 2, 37, d, dtype=torch.float16, device="meta", requires_grad=True) for d in (20, 20, 12))
    assert implementation_for("block_softmax" if op == "block" else "lln_diag", "fused", q, v) == "fused"
    fn = block if op == "block" else lln_diag
    out = fn(q, k, v, "fused", causal=False, mask=torch.zeros(2, 37, dtype=torch.bool, device="meta"))
    assert out.shape == (2, 2, 37, 12) and out.dtype == torch.float16
    q2, k2, v2 = inputs(gen, torch.float16, 16)
    with count_dispatch() as c:
        fn(q2, k2, v2, "fused", causal=False, mask=None).sum().backward()
    assert c.ops["block_softmax"] == 1 and c.ops["block_softmax_backward"] == 1


@pytest.mark.parametrize("op", ["block", "lln_diag"])
def test_compile_fullgraph_sees_one_block_custom_op(gen, op):
    q, k, v = (t.detach() for t in inputs(gen, torch.bfloat16, 19))
    fn = block if op == "block" else lln_diag
    compiled = lambda q, k, v: fn(q, k, v, "fused", causal=True, mask=None)  # noqa: E731
    assert compiled_op_count(compiled, (q, k, v), "block_softmax") == 1

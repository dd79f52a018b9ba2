"""Skyformer's fused implementation (``linattn/ops/skyformer/fused.py``, kernels ``linattn/ops/triton/nystrom*.py``) run
by Triton's interpreter on CPU tensors: forward and input gradients (the landmarks' share included) against the
float64 Nyström form C_Q M^-1 C_K^T V (Skyformer eq. 6, materialised) within ``linattn/tolerances.py``, padding left
and right, odd and tiny lengths, unused landmark slots, both landmark modes, random and evenly spaced landmarks, fp16
and bf16; padded rows' contents reach nothing; reductions over several splits; tf32 products; a sequence's output
independent of its batch; the meta device; one custom op each way, for the op counter and ``torch.compile``."""
import json

import pytest
import torch
from helpers import LAYOUT_CASES, check_fused_layouts, compiled_op_count, padding_mask, rel_err

from linattn import ops
from linattn.ops.impls import ImplementationError, implementation_for
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Skyformer's M^-1 kernels cost seconds a call under the interpreter: of a family of cases that walk the same
# kernel paths, one stays in the default tier and its twins run in the extended one (docs/development.md)
EXTENDED = pytest.mark.extended


def inputs(gen, dtype, n, b=2, h=2, d=20, dv=12):
    """q, k (B,H,N,D), v (B,H,N,Dv) in ``dtype``, leaves that require grad; D and Dv not powers of two."""
    return [torch.randn(b, h, n, w, generator=gen).to(dtype).requires_grad_() for w in (d, d, dv)]


def run(q, k, v, impl, *, mask=None, seed=None, **options):
    """Skyformer with ``impl``; evenly spaced landmarks (eval) unless ``seed`` draws them (training)."""
    options = {"num_landmarks": 6, **options}
    if seed is not None:
        options.update(training=True, generator=torch.Generator().manual_seed(seed))
    else:
        options.setdefault("training", False)
    return ops.skyformer_attention(q, k, v, key_padding_mask=mask, impl=impl, **options)


def nystrom_reference(q, k, v, *, mask=None, seed=None, **options):
    """C_approx V (B,H,N,Dv) in float64: the materialised Nyström form with the same landmarks, padded values 0."""
    options = {"num_landmarks": 6, **options}
    if seed is not None:
        options.update(training=True, generator=torch.Generator().manual_seed(seed))
    else:
        options.setdefault("training", False)
    v0 = v if mask is None else v.masked_fill(mask[:, None, :, None], 0.0)
    return ops.skyformer_kernel_matrix(q, k, key_padding_mask=mask, **options) @ v0


def check_against_reference(gen, q, k, v, dtype, *, mask, **options):
    out = run(q, k, v, "fused", mask=mask, **options)
    grad = torch.randn(out.shape, generator=gen)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = nystrom_reference(*leaves, mask=mask, **options)
    want = torch.autograd.grad(ref, leaves, grad.double())
    assert out.dtype == q.dtype and rel_err(out, ref) < tolerance("skyformer", dtype)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad.to(out.dtype)), want):
        assert g.dtype == q.dtype and rel_err(g, w) < tolerance("skyformer", dtype, gradient=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, side, landmarks", [(1, None, 6), (3, "right", 8), (7, "left", 6), (19, "right", 6),
                                                (19, "left", 40)])
def test_fused_matches_the_float64_nystrom_form_with_gradients(gen, dtype, n, side, landmarks):
    """n = 3 with 8 landmarks: fewer valid rows than slots (unused slots); 40 landmarks: not a power of two."""
    q, k, v = inputs(gen, DTYPES[dtype], n)
    mask = padding_mask(2, n, side, gen) if side else None
    assert implementation_for("skyformer", "fused", q, v, num_landmarks=landmarks) == "fused"
    check_against_reference(gen, q, k, v, dtype, mask=mask, num_landmarks=landmarks)


@pytest.mark.parametrize("dtype, mode", [("float16", "stratified"), ("bfloat16", "uniform"),
                                         pytest.param("bfloat16", "stratified", marks=EXTENDED),
                                         pytest.param("float16", "uniform", marks=EXTENDED)])
def test_fused_with_random_landmarks_matches_the_reference(gen, dtype, mode):
    """Training: landmarks drawn at random (the same draw for the same generator state), in either mode."""
    q, k, v = inputs(gen, DTYPES[dtype], 17)
    check_against_reference(gen, q, k, v, dtype, mask=padding_mask(2, 17, "left", gen), seed=5, mode=mode)


@pytest.mark.parametrize("side", ["left", pytest.param("right", marks=EXTENDED)])
def test_padded_rows_reach_nothing_whatever_they_hold(gen, side):
    """Padded queries are zero queries and padded keys' rows of C are 0: 6e4 in their q and k and inf in their v
    change no output and no gradient, bit for bit."""
    q, k, v = (t.detach() for t in inputs(gen, torch.float16, 13))
    mask = padding_mask(2, 13, side, gen)
    grad = torch.randn(2, 2, 13, 12, generator=gen).to(torch.float16)
    results = []
    for fills in ((0.0, 0.0, 0.0), (6e4, -6e4, float("inf"))):
        held = [t.masked_fill(mask[:, None, :, None], f).requires_grad_() for t, f in zip((q, k, v), fills)]
        out = run(*held, "fused", mask=mask)
        results.append([out, *torch.autograd.grad(out, held, grad)])
    for got, want in zip(*results):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=EXTENDED)])
def test_fused_with_wide_heads_matches_the_reference(gen, dtype):
    """D = 72, Dv = 80: blocks of 128, at ``LAUNCH_128``'s settings (the backward's ``_rows_grad`` and
    ``_landmarks_grad`` in tf32; ``_rows_grad`` 64 rows a step over blocks of 16 landmarks: the 24 in two, the second
    partial; ``_landmarks_grad`` 16 rows a step: N = 37 in three steps, the last one partial; dV by ``_readout``)."""
    q, k, v = inputs(gen, DTYPES[dtype], 37, d=72, dv=80)
    check_against_reference(gen, q, k, v, dtype, mask=padding_mask(2, 37, "left", gen), num_landmarks=24)


def test_wide_heads_over_several_landmark_blocks_and_row_steps(gen, monkeypatch):
    """The backward at D = 72, Dv = 80 with 40 landmarks in blocks of 16 (BJ), the last one partial: ``_rows_grad``
    sums each step's dE L and rowsum(dE) over three blocks, 16 rows a step (N = 37: three steps, the last one
    partial), and ``_landmarks_grad`` takes a block a program (its rows of dL/dL apart)."""
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"nystrom_rows_grad": {"BLOCK": 16, "BJ": 16},
                                                            "nystrom_landmarks_grad": {"BJ": 16}}))
    q, k, v = inputs(gen, torch.float16, 37, d=72, dv=80)
    check_against_reference(gen, q, k, v, "float16", mask=padding_mask(2, 37, "right", gen), num_landmarks=40)


@pytest.mark.parametrize("side", ["left", pytest.param("right", marks=EXTENDED)])
def test_unused_landmark_slots_on_padded_rows_reach_nothing(gen, side):
    """A sequence with 4 real tokens of 13 and 16 landmarks (8 from Q, 8 from K): its unused slots point at padded
    rows, whose inf in q, k and v changes no output and no gradient, bit for bit (the landmarks gathered masked)."""
    q, k, v = (t.detach() for t in inputs(gen, torch.float16, 13))
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[1, :9] = True
    mask = mask if side == "left" else mask.flip(1)
    grad = torch.randn(2, 2, 13, 12, generator=gen).to(torch.float16)
    results = []
    for fill in (0.0, float("inf")):
        fills = (fill, -fill, fill)
        held = [t.masked_fill(mask[:, None, :, None], f).requires_grad_() for t, f in zip((q, k, v), fills)]
        out = run(*held, "fused", mask=mask, num_landmarks=16)
        results.append([out, *torch.autograd.grad(out, held, grad)])
    for got, want in zip(*results):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("side, split_rows", [("left", 16), ("right", 32), pytest.param("right", 16, marks=EXTENDED),
                                              pytest.param("left", 32, marks=EXTENDED)])
def test_fused_over_several_splits(gen, monkeypatch, side, split_rows):
    """The reductions (C_K^T V, C_Q^T grad, dL/dL) split over the rows, each split's share summed after: at N = 50,
    4 splits of one step or 2 of two steps (the state's and dL/dL's BLOCK = 16), the last one partial; the second
    sequence padded on the left over 37 rows (whole splits of padding) or on the right over 13."""
    from linattn.ops.triton import nystrom
    monkeypatch.setattr(nystrom, "ROWS", 16)  # read at call time, by the forward and the backward
    monkeypatch.setattr(nystrom, "SPLIT_ROWS", split_rows)
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"nystrom_state": {"BLOCK": 16},
                                                            "nystrom_landmarks_grad": {"BLOCK": 16},
                                                            "nystrom_rows_grad": {"BLOCK": 8}}))
    q, k, v = inputs(gen, torch.float16, 50)
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[1, :37] = side == "left"
    mask[1, 37:] = side == "right"
    check_against_reference(gen, q, k, v, "float16", mask=mask, num_landmarks=12)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=EXTENDED)])
def test_fused_with_exact_fp32_products_matches_the_reference(gen, monkeypatch, dtype):
    """``TF32``: the products of unbounded operands are rounded to tf32 by default; with TF32 false (exact fp32 FMA
    products, a tuning choice) the op also stays within the tolerances, and the default's rounding is applied."""
    q, k, v = inputs(gen, DTYPES[dtype], 19)
    mask = padding_mask(2, 19, "right", gen)
    grad = torch.randn(2, 2, 19, 12, generator=gen).to(DTYPES[dtype])

    def values():
        out = run(q, k, v, "fused", mask=mask)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    tf32 = values()
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"nystrom_readout": {"TF32": False},
                                                            "nystrom_rows_grad": {"TF32": False},
                                                            "nystrom_landmarks_grad": {"TF32": False}}))
    check_against_reference(gen, q, k, v, dtype, mask=mask)
    assert all(not torch.equal(a, b) for a, b in zip(values(), tf32))


@pytest.mark.parametrize("layouts", [LAYOUT_CASES[1], *(pytest.param(c, marks=EXTENDED) for c in LAYOUT_CASES[::2]),
                                     pytest.param(LAYOUT_CASES[3], marks=EXTENDED)])
def test_fused_reads_fairseqs_layout_in_place_and_answers_in_it(gen, layouts):
    """q, k, v and dL/d(out) in fairseq's layout, contiguous or another: the contiguous run's output and gradients,
    bit for bit, in the inputs' layouts where the kernels read them in place (``helpers.check_fused_layouts``)."""
    q, k, v = inputs(gen, torch.float16, 11)
    mask = padding_mask(2, 11, "left", gen)
    grad = torch.randn(2, 2, 11, 12, generator=gen).half()
    check_fused_layouts(lambda *qkv: run(*qkv, "fused", mask=mask), (q, k, v), grad, layouts)


def test_a_sequence_output_does_not_depend_on_its_batch(gen):
    """Eval: the landmarks are per sequence and every reduction per head, so a sequence alone gives the same output
    and gradients as in a batch, bit for bit."""
    q, k, v = (t.detach() for t in inputs(gen, torch.bfloat16, 21, b=3))
    mask = padding_mask(3, 21, "left", gen)
    grad = torch.randn(3, 2, 21, 12, generator=gen).to(torch.bfloat16)

    def values(i):
        leaves = [t[i].requires_grad_() for t in (q, k, v)]
        out = run(*leaves, "fused", mask=mask[i])
        return [out, *torch.autograd.grad(out, leaves, grad[i])]

    for got, want in zip(values(slice(1, 2)), values(slice(None))):
        assert torch.equal(got, want[1:2])


def test_what_the_kernels_cannot_take_is_refused_naming_why():
    half = torch.randn(1, 2, 100, 8, dtype=torch.float16)
    assert implementation_for("skyformer", "fused", half, num_landmarks=128) == "fused"
    with pytest.raises(ImplementationError, match="129 landmarks > 128"):  # d > 128
        implementation_for("skyformer", "fused", half, num_landmarks=129)
    assert implementation_for("skyformer", "fused", half[:, :, :60], num_landmarks=256) == "fused"  # 2N = 120 rows
    q = half.float()[:, :, :9]
    with pytest.raises(ImplementationError, match=r"dtype torch.float32 not in \(float16, bfloat16\)"):
        run(q, q, q, "fused")  # fp32: half inputs only


def test_fused_runs_on_the_meta_device_forward_and_backward():
    q, k, v = (torch.empty(2, 2, 37, d, dtype=torch.float16, device="meta", requires_grad=True) for d in (20, 20, 12))
    assert implementation_for("skyformer", "fused", q, v) == "fused"
    out = run(q, k, v, "fused", mask=torch.zeros(2, 37, dtype=torch.bool, device="meta"))
    assert out.shape == (2, 2, 37, 12) and out.dtype == torch.float16
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_one_custom_op_each_way_and_a_fixed_op_count(gen):
    """The apply and M^-1's iteration one op each way (the iteration was about 130 d×d ATen ops): 62 ops a step."""
    counts = []
    for n in (16, 64):
        q, k, v = inputs(gen, torch.float16, n, b=1)
        with count_dispatch() as c:
            run(q, k, v, "fused").sum().backward()
        assert c.ops["nystrom_apply"] == 1 and c.ops["nystrom_apply_backward"] == 1
        assert c.ops["nystrom_inverse"] == 1 and c.ops["nystrom_inverse_backward"] == 1
        assert not {"bmm", "baddbmm"} & set(c.ops)
        counts.append(c.launched)
    assert counts[0] == counts[1] <= 62


def test_compile_fullgraph_sees_one_custom_op(gen):
    q, k, v = (t.detach() for t in inputs(gen, torch.bfloat16, 19, b=1))
    assert compiled_op_count(lambda q, k, v: run(q, k, v, "fused"), (q, k, v), "nystrom_apply") == 1


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_at_a_larger_shape_matches_the_reference(gen, dtype):
    q, k, v = inputs(gen, DTYPES[dtype], 300, d=64, dv=64)
    check_against_reference(gen, q, k, v, dtype, mask=padding_mask(2, 300, "right", gen), num_landmarks=128)


def test_a_sequence_without_a_real_token_gets_zero(gen):
    q, k, v = inputs(gen, torch.float16, 9)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1] = True
    out = run(q, k, v, "fused", mask=mask)
    grads = torch.autograd.grad(out.float().square().sum() + out.sum(), (q, k, v))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    assert all(torch.isfinite(g).all() and torch.equal(g[1], torch.zeros_like(g[1])) for g in grads)

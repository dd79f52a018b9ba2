"""Skyformer's fast implementations (looped: C_Q, C_K rebuilt pass by pass; parallel: all rows at once) equal C_approx V
and each other, float64 gradcheck with padding, and the iterative M^-1's hand-written backward."""
import pytest
import torch
from helpers import padding_mask, rel_err

from linattn import ops
from linattn.compile_shapes import compile_varying_lengths
from linattn.ops import working_set
from linattn.ops.skyformer.nystrom import landmark_inverse as _kernel_inverse


@pytest.fixture(params=["looped-one-pass", "looped-many-passes", "parallel"])
def impl(request, monkeypatch):
    """The op's ``impl``; the looped implementation in one pass over the rows or in one pass per row."""
    if request.param == "looped-many-passes":
        monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)
    return request.param.split("-")[0]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("exact_inverse", [False, True])
def test_skyformer_equals_its_kernel_matrix_times_values(gen, impl, padded, exact_inverse):
    q, k, v = (torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, 13, "left", gen) if padded else None
    kw = dict(num_landmarks=6, key_padding_mask=mask, training=False, exact_inverse=exact_inverse)
    out = ops.skyformer_attention(q, k, v, impl=impl, **kw)
    c = ops.skyformer_kernel_matrix(q, k, **kw)
    v0 = v if mask is None else v.masked_fill(mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, c @ v0, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mode,exact_inverse", [("stratified", False), ("uniform", False), ("stratified", True)])
def test_skyformer_gradcheck_float64(gen, impl, padded, mode, exact_inverse):
    q, k, v = (torch.randn(2, 1, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(2, 6, "right", gen) if padded else None
    fn = lambda q, k, v: ops.skyformer_attention(q, k, v, num_landmarks=4, key_padding_mask=mask, mode=mode,
                                                 training=False, exact_inverse=exact_inverse, impl=impl)
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 65])
@pytest.mark.parametrize("side", [None, "left", "right"])
@pytest.mark.parametrize("training", [True, False])
def test_parallel_equals_looped_with_gradients(gen, n, side, training):
    """Same landmarks (same generator state), same values and gradients to float64 rounding."""
    q, k, v = (torch.randn(3, 2, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(3, n, side, gen) if side else None
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    g = torch.randn(3, 2, n, 8, generator=gen, dtype=torch.float64)
    results = []
    for impl in ("parallel", "looped"):
        out = ops.skyformer_attention(q, k, v, num_landmarks=5, key_padding_mask=mask, training=training,
                                      generator=torch.Generator().manual_seed(seed), impl=impl)
        results.append([out, *torch.autograd.grad(out, (q, k, v), g)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parallel_half_inputs_compute_in_float32_like_looped(gen, dtype):
    """Half inputs: both implementations upcast the same half values, so they agree to float32 rounding (then
    half's)."""
    q, k, v = (torch.randn(2, 2, 33, 16, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    mask = padding_mask(2, 33, "right", gen)
    g = torch.randn(2, 2, 33, 16, generator=gen).to(dtype)
    results = []
    for impl in ("parallel", "looped"):
        out = ops.skyformer_attention(q, k, v, num_landmarks=8, key_padding_mask=mask, training=False, impl=impl)
        assert out.dtype == dtype
        results.append([out, *torch.autograd.grad(out, (q, k, v), g)])
    tol = 2e-3 if dtype == torch.float16 else 1e-2  # half's rounding of float32 values; measured 4e-4 / 2.6e-3
    for got, want in zip(*results):
        assert got.dtype == dtype and rel_err(got, want) < tol


@pytest.mark.parametrize("gamma", [0.1, 0.0])
def test_iterative_inverse_gradcheck_with_unused_slots(gen, gamma):
    """M^-1 from the landmarks through the 6-step iteration (hand-written backward), an element with unused slots."""
    land = (0.7 * torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    used = torch.tensor([[True] * 5, [True, True, True, False, False]])
    assert torch.autograd.gradcheck(lambda x: _kernel_inverse(x, used, gamma, False), (land,))


@pytest.mark.extended  # compile handling: CI compiles one module case (tests/plugin/test_attention_compile.py)
@pytest.mark.parametrize("method", ["skyformer", "kernelized"])
def test_parallel_form_compiles_in_one_graph_and_equals_eager(gen, method):
    """``compile_varying_lengths(fn, fullgraph=True)``, as ``--attention-compile`` compiles: no graph break, and
    values and gradients as eager (eval landmarks: Inductor's random numbers are not eager's)."""
    mask = padding_mask(2, 37, "right", gen)
    if method == "skyformer":
        fn = lambda q, k, v: ops.skyformer_attention(q, k, v, num_landmarks=6, key_padding_mask=mask,  # noqa: E731
                                                     training=False, impl="parallel")
    else:
        fn = lambda q, k, v: ops.kernelized_attention(q, k, v, key_padding_mask=mask, impl="parallel")  # noqa: E731
    compiled = compile_varying_lengths(fn, fullgraph=True)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=gen, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 3, 37, 8, generator=gen)
    results = []
    for f in (fn, compiled):
        out = f(q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), g)])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

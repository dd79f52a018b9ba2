"""Skyformer fast path (C_Q, C_K rebuilt pass by pass): equals C_approx V, float64 gradcheck with padding."""
import pytest
import torch
from conftest import padding_mask

from linattn import ops
from linattn.ops import working_set


@pytest.fixture(params=[False, True], ids=["one-pass", "many-passes"])
def passes(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("exact_inverse", [False, True])
def test_skyformer_equals_its_kernel_matrix_times_values(gen, passes, padded, exact_inverse):
    q, k, v = (torch.randn(2, 3, 13, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(2, 13, "left", gen) if padded else None
    kw = dict(num_landmarks=6, key_padding_mask=mask, training=False, exact_inverse=exact_inverse)
    out = ops.skyformer_attention(q, k, v, **kw)
    c = ops.skyformer_kernel_matrix(q, k, **kw)
    v0 = v if mask is None else v.masked_fill(mask[:, None, :, None], 0.0)
    torch.testing.assert_close(out, c @ v0, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mode,exact_inverse", [("stratified", False), ("uniform", False), ("stratified", True)])
def test_skyformer_gradcheck_float64(gen, passes, padded, mode, exact_inverse):
    q, k, v = (torch.randn(2, 1, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask(2, 6, "right", gen) if padded else None
    fn = lambda q, k, v: ops.skyformer_attention(q, k, v, num_landmarks=4, key_padding_mask=mask, mode=mode,
                                                 training=False, exact_inverse=exact_inverse)
    assert torch.autograd.gradcheck(fn, (q, k, v))

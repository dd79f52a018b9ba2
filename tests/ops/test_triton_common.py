"""The Triton kernels' shared pieces (``linattn/ops/triton/common.py``) under the interpreter: ``wide_dot``'s three
precisions (exact fp32, tf32, tf32x3) against float64 products, and ``launch``'s TF32 setting."""
import json

import pytest
import torch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from linattn.ops.triton.common import launch, wide_dot  # noqa: E402


@triton.jit
def _product(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, WIDE: tl.constexpr):
    i = tl.arange(0, M)
    k = tl.arange(0, K)
    j = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + j[None, :])
    tl.store(out_ptr + i[:, None] * N + j[None, :], wide_dot(a, b, WIDE))


def product_error(gen, wide: int) -> float:
    """The largest error of ``wide_dot`` at WIDE over |a| |b| (the scale of a product's rounding), (32,64)@(64,16)
    with entries spread over 8 binades."""
    a, b = (torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-4, 4, shape, generator=gen)
            for shape in ((32, 64), (64, 16)))
    out = torch.empty(32, 16)
    _product[(1,)](a, b, out, M=32, K=64, N=16, WIDE=wide)
    return ((out.double() - a.double() @ b.double()).abs() / (a.double().abs() @ b.double().abs())).max().item()


def test_wide_dot_precisions(gen):
    """fp32 products (WIDE 0) are good to fp32's 2^-24 a term, tf32 (2) to its 2^-11, tf32x3 (4) to about fp32's
    again: each level's error bound fails the coarser one."""
    exact, tf32, tf32x3 = (product_error(gen, w) for w in (0, 2, 4))
    assert exact < 2e-6 and 2e-4 < tf32 < 2e-3 and tf32x3 < 1e-5


def test_launch_maps_tf32_to_the_kernels_wide_setting(monkeypatch):
    """Under the interpreter each tensor-core rounding is emulated (WIDE one more); another TF32 value is refused
    with the allowed ones."""
    assert launch("lln_causal_grads", 64)["WIDE"] == 2  # LAUNCH's tf32, its rounding emulated
    for value, wide in ((True, 2), ("x3", 4), (False, 0)):
        monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_grads": {"TF32": value}}))
        assert launch("lln_causal_grads", 64)["WIDE"] == wide
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_grads": {"TF32": "x2"}}))
    with pytest.raises(ValueError, match='TF32 must be false, true or "x3"'):
        launch("lln_causal_grads", 64)


def test_launch_takes_the_wide_block_settings_where_d_or_dv_needs_a_block_of_128(monkeypatch):
    """``LAUNCH_128`` replaces LAUNCH's settings where D or Dv is over 64 (blocks of 128), not at 64 or below; the
    environment's override still wins."""
    from linattn.ops.triton import common

    base = launch("lln_causal_grads", 64)
    monkeypatch.setattr(common, "LAUNCH_128", {"lln_causal_grads": {"num_warps": 2 * base["num_warps"]}})
    assert launch("lln_causal_grads", 64) == launch("lln_causal_grads", 40, 64) == base
    for d, dv in ((65, 0), (128, 0), (64, 100)):
        assert launch("lln_causal_grads", d, dv) == {**base, "num_warps": 2 * base["num_warps"]}, (d, dv)
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_grads": {"num_warps": 1}}))
    assert launch("lln_causal_grads", 128)["num_warps"] == 1

"""The Triton kernels' shared pieces (``linattn/ops/triton/common.py``) under the interpreter: ``wide_dot``'s three
precisions (exact fp32, tf32, tf32x3) against float64 products, and ``launch``'s TF32 setting."""
import json

import pytest
import torch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from helpers import fairseq_layout, packed_layout, siblings_layout  # noqa: E402

from linattn.ops.packed_heads import packs_grads  # noqa: E402
from linattn.ops.triton.common import (  # noqa: E402
    each_in_layout,
    grads_of,
    head_stride,
    inputs_in_layout,
    launch,
    new_grads,
    op_grads,
    packed_siblings,
    wide_dot,
)


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

    kernel = "lln_noncausal_rows_grad"  # no BF or BV, which a block caps
    base = launch(kernel, 64)
    monkeypatch.setattr(common, "LAUNCH_128", {kernel: {"num_warps": 2 * base["num_warps"]}})
    assert launch(kernel, 64) == launch(kernel, 40, 64) == base
    for d, dv in ((65, 0), (128, 0), (64, 100)):
        assert launch(kernel, d, dv) == {**base, "num_warps": 2 * base["num_warps"]}, (d, dv)
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({kernel: {"num_warps": 1}}))
    assert launch(kernel, 128)["num_warps"] == 1


def test_launch_settings_follow_a_replaced_table_and_are_the_callers_own(monkeypatch):
    """``launch`` works its answer out once per kernel, sizes, override and table (every kernel call asks): a table
    replaced after a call (as the test above does) is seen, not the answer cached before; an answer changed by its
    caller changes no later one."""
    from linattn.ops.triton import common

    before = launch("lln_causal_grads", 128)
    monkeypatch.setattr(common, "LAUNCH_128", {"lln_causal_grads": {"num_warps": 1}})
    assert launch("lln_causal_grads", 128)["num_warps"] == 1
    changed = {**common.LAUNCH["lln_causal_grads"], "num_stages": 3}
    monkeypatch.setattr(common, "LAUNCH", {**common.LAUNCH, "lln_causal_grads": changed})
    assert launch("lln_causal_grads", 128)["num_stages"] == 3
    monkeypatch.undo()
    mine = launch("lln_causal_grads", 128)
    assert mine == before
    mine["num_warps"] = 99
    assert launch("lln_causal_grads", 128) == before


@pytest.mark.parametrize("b, h, n", [(2, 3, 5), (1, 3, 5), (2, 1, 5), (1, 1, 5), (2, 3, 1)])
def test_head_stride_tells_fairseqs_own_and_packed_layouts_from_the_others(b, h, n):
    x = torch.randn(b, h, n, 4)
    assert head_stride(fairseq_layout(x)[0]) == 4
    assert head_stride(packed_layout(x)[0]) == 12
    if n > 1 and b * h > 1:  # a contiguous tensor of one row, or of one head, is also fairseq's
        assert head_stride(x) is None
        assert head_stride(x.transpose(0, 1)) is None


def test_packed_siblings_are_read_in_place_and_their_gradients_go_into_one_tensor_laid_out_alike():
    """The module's q, k, v (views of one (N,B,H,3D) tensor) reach the kernels themselves (no copy) at X = 3D, and
    the backward's dq, dk, dv are views of one new such tensor; q, k, v packed apart (not siblings) are copied to
    fairseq's own layout, their gradients in it; a gradient of the output is read in its own layout."""
    q, k, v = siblings_layout(*torch.randn(3, 2, 3, 5, 4).unbind(0))
    assert packed_siblings(q, k, v) and not packed_siblings(k, q, v) and not packed_siblings(q, k, k)
    grad = packed_layout(torch.randn(2, 3, 5, 4))[0]
    fairseq, sqk, sv, got = inputs_in_layout(q, k, v, grad)
    assert fairseq and (sqk, sv) == (12, 12) and all(a is b for a, b in zip(got[:3], (q, k, v)))
    assert head_stride(got[3]) == 4 and torch.equal(got[3], grad)
    *grads, packed = new_grads(q, k, v, packs_grads(q, k, v))
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)] and packed.shape == (2, 3, 5, 12)
    assert [g.data_ptr() - packed.data_ptr() for g in grads] == [0, 16, 32]
    returned = op_grads(*grads, packed)
    assert [t.numel() for t in returned[:3]] == [0, 0, 0] and returned[3] is packed
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(grads_of(*returned, 4), grads))
    apart = packed_layout(*(t.contiguous() for t in (q, k, v)))
    fairseq, sqk, sv, got = inputs_in_layout(*apart)
    assert (sqk, sv) == (4, 4) and all(head_stride(t) == 4 and torch.equal(t, a) for t, a in zip(got, apart))
    *grads, stand_in = new_grads(*apart, packs_grads(*apart))
    assert all(head_stride(g) == 4 for g in grads) and stand_in.shape == (0,)
    assert grads_of(*op_grads(*grads, stand_in), 4) == tuple(grads)
    fairseq, strides, got = each_in_layout(q, fairseq_layout(k)[0], grad)
    assert strides == (12, 4, 12) and got[0] is q and got[2] is grad


def test_walk_grid_is_kept_per_shape_and_launch_settings(monkeypatch):
    """``walk_grid`` works its launches out once per shape and launch settings (``common._launch_key``): the same
    shape under another SPLIT (``LINATTN_TRITON_LAUNCH``, or a replaced table), backward, or another length gets its
    own walks; the settings it hands out are read-only (one answer shared by every call)."""
    from linattn.ops.triton import common

    shape = (1, 2, 64, 16, 16, 8)  # 8 chunks: one segment at LAUNCH's SPLIT
    before = common.walk_grid(*shape)
    assert before[1].seg == 8 and common.walk_grid(1, 2, 128, 16, 16, 8)[1].seg == 16
    grad_walk = launch("lln_causal_grad_states", 16)
    del grad_walk["SPLIT"]
    assert common.walk_grid(*shape, backward=True)[1].settings == grad_walk
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": {"SPLIT": 2}}))
    assert common.walk_grid(*shape)[1].seg == 2
    monkeypatch.delenv("LINATTN_TRITON_LAUNCH")
    walk = {**common.LAUNCH["lln_causal_states"], "SPLIT": 4}
    monkeypatch.setattr(common, "LAUNCH", {**common.LAUNCH, "lln_causal_states": walk})
    assert common.walk_grid(*shape)[1].seg == 4
    monkeypatch.undo()
    assert common.walk_grid(*shape) == before
    with pytest.raises(TypeError):
        before[1].settings["BF"] = 1

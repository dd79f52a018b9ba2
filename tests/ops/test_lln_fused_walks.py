"""Causal LLN's fused walks over the chunks (``linattn/ops/triton/lln_causal.py``' ``_states``,
``lln_causal_backward.py``' ``_grad_states``, ``common.walk_grid``) run by Triton's interpreter: split over value
columns and over segments of chunks against the float64 reference (LLN eq. 8-9), padding left and right, fp16 and
bf16; the walks' grids and serial steps at the training shape, and a fixed set of launches whatever N. The shared
inputs and reference check are test_lln_fused.py's."""
import json

import pytest
import torch
from helpers import padding_mask
from test_lln_fused import DTYPES, EXTENDED, TWO_OF_FOUR, check_against_reference, inputs, run

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (common.py)


@pytest.mark.parametrize("dtype, side", TWO_OF_FOUR)
def test_causal_fused_walks_split_over_value_columns(gen, monkeypatch, dtype, side):
    """BV (``triton/common.LAUNCH``, a tuning choice) below Dv: the walks over the chunks (states, and G_c in the
    backward, its go's ones column over the value columns a block at a time) split over value columns as well, 3
    blocks of 16 for Dv = 40 (the last partial), the ones column written once, and so do the forward's ``_outputs``
    (the shifts and den stored once) and the backward's ``_value_grads`` (dv), while its ``_grads`` (dq, dk) splits
    D = 20 into 2 blocks of 16 features (BF, the last partial: each block its rows of S_c and G_c, the in-chunk
    product formed whole by each, over the value columns 16 at a time); ``_outputs`` and ``_value_grads`` read the
    features 16 at a time (2 steps, the last partial); against the float64 reference."""
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": {"BV": 16},
                                                            "lln_causal_outputs": {"BF": 16, "BV": 16},
                                                            "lln_causal_grad_states": {"BV": 16},
                                                            "lln_causal_grads": {"BF": 16, "BV": 16},
                                                            "lln_causal_value_grads": {"BF": 16, "BV": 16}}))
    q, k, v = inputs(gen, DTYPES[dtype], 19, dv=40)
    check_against_reference(gen, q, k, v, dtype, causal=True, mask=padding_mask(2, 19, side, gen))


@pytest.mark.parametrize("dtype, side", [("bfloat16", "left"), pytest.param("float16", "right", marks=EXTENDED)])
def test_causal_fused_at_head_sizes_in_blocks_of_128(gen, dtype, side):
    """D = 80, Dv = 96 (blocks of 128: ``LAUNCH_128``'s settings, which split every kernel of a D = 128 head): the
    forward's outputs in programs of 64 value columns (the last partial) over steps of 32 features (the last
    partial), the backward's walk in programs of 64 value columns, its dq, dk in blocks of 32 features (the last
    partial) over steps of 32 value columns, its dv over steps of 32 features; against the float64 reference."""
    from linattn.ops.triton.common import launch

    outputs, walk, qk, values = (launch(key, 80, 96) for key in (
        "lln_causal_outputs", "lln_causal_grad_states", "lln_causal_grads", "lln_causal_value_grads"))
    assert (outputs["BF"], outputs["BV"], walk["BV"], qk["BF"], qk["BV"], values["BF"]) == (32, 64, 64, 32, 32, 32)
    q, k, v = inputs(gen, DTYPES[dtype], 19, d=80, dv=96)
    check_against_reference(gen, q, k, v, dtype, causal=True, mask=padding_mask(2, 19, side, gen))


@pytest.mark.parametrize("dtype, side", TWO_OF_FOUR)
def test_causal_fused_walks_in_segments_match_the_reference(gen, monkeypatch, dtype, side):
    """The walks over the chunks in segments (``common.walk_grid``: each segment's end from a zero state, then each
    segment from its carry over the others' ends): 5 chunks of 8 rows in segments of 2 (the last of one chunk); on
    the left the second sequence's first 19 rows padded (the first segment all padding: a carry with no key yet,
    whose maximum is 0, its first key in the second) and the first's second chunk; on the right the first
    sequence's tail from row 21 (the last segment all padding, the running maximum carried through it) and the
    second's second chunk: whole chunks of padding inside segments; half the features' keys growing along the
    sequence, half shrinking (the maximum moves in every chunk, or the earliest segment holds it: each shift between
    segments counts, the carried state's and the later segment's end's); against the float64 reference."""
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": {"SPLIT": 2},
                                                            "lln_causal_grad_states": {"SPLIT": 2}}))
    q, k, v = inputs(gen, DTYPES[dtype], 37, d=16)
    grow = torch.linspace(0.5, 3.0, 37).view(37, 1)
    with torch.no_grad():  # half the features' keys growing along the sequence, half shrinking
        k.mul_(torch.cat([grow.expand(37, 8), grow.flip(0).expand(37, 8)], 1).to(k.dtype))
    mask = torch.zeros(2, 37, dtype=torch.bool)
    if side == "left":
        mask[1, :19] = True
        mask[0, 8:16] = True
    else:
        mask[0, 21:] = True
        mask[1, 8:16] = True
    check_against_reference(gen, q, k, v, dtype, causal=True, mask=mask)


def test_causal_walks_occupy_an_h100_and_launch_a_fixed_count(gen, monkeypatch):
    """At (B, H, N, D = Dv, chunk) = (1, 12, 32768, 64, 64) every launch of the causal walks (forward and backward,
    ends and walk: ``common.walk_grid``, whose grids the ops launch) has at least 264 programs (two waves of an
    H100's 132 SMs; one program a head and feature block had 48, each walking 512 chunks) of at most 64 serial
    steps; and the ops launch the same kernels whatever N (N = 16 in one segment, N = 64 in four), the walks at
    ``walk_grid``'s grids."""
    from triton.runtime.interpreter import InterpretedFunction

    from linattn.ops.triton.common import walk_grid

    for backward in (False, True):
        for level in walk_grid(1, 12, 32768, 64, 64, 64, backward):
            assert level.grid[0] * level.grid[1] * level.grid[2] >= 264 and 0 < level.steps <= 64, (backward, level)
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": {"SPLIT": 2},
                                                            "lln_causal_grad_states": {"SPLIT": 2}}))
    launched = []
    original = InterpretedFunction.__getitem__

    def recorded(kernel, grid):
        launched.append((kernel.fn.__name__, tuple(grid)))
        return original(kernel, grid)

    monkeypatch.setattr(InterpretedFunction, "__getitem__", recorded)
    kernels = []
    for n in (16, 64):
        launched.clear()
        q, k, v = inputs(gen, torch.float16, n, b=1)
        run(q, k, v, "fused", causal=True).sum().backward()
        walks = [grid for name, grid in launched if name in ("_states", "_grad_states")]
        assert walks == [level.grid for backward in (False, True) for level in walk_grid(1, 2, n, 20, 12, 8, backward)]
        kernels.append([name for name, _ in launched])
    assert kernels[0] == kernels[1] == ["_states", "_states", "_outputs", "_grad_states", "_grad_states", "_grads",
                                        "_value_grads"]
    assert walks[0][0] == 3 * 2 and walks[2][0] == 3 * 2  # N = 64: 8 chunks, 4 segments, 3 ends a head


@pytest.mark.extended
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_fused_walks_in_segments_at_a_larger_shape(gen, monkeypatch, dtype):
    """D = Dv = 64 (4 feature blocks of 16) and 13 chunks of 16 in segments of 3 (the last of one chunk), padded on
    the right: against the float64 reference."""
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({"lln_causal_states": {"SPLIT": 3},
                                                            "lln_causal_grad_states": {"SPLIT": 3}}))
    q, k, v = inputs(gen, DTYPES[dtype], 200, d=64, dv=64, scale=1.5)
    check_against_reference(gen, q, k, v, dtype, causal=True, mask=padding_mask(2, 200, "right", gen), chunk=16)

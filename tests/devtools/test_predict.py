"""The CPU proxies of GPU speed: an SM's blocks and occupancy from a kernel's registers, warps and shared memory
(``dev.perf.kernel_resources.occupancy``), the specialisation a kernel's launches get (``dev.perf.launches``,
``kernel_resources.specialised``), and the predicted H100 step (``dev.perf.predict``) and its committed table."""
import json
import math

import pytest
from helpers import ROOT

from dev.perf.kernel_resources import occupancy
from dev.perf.predict import H100, kernel_time

pytest.importorskip("triton", minversion="3.6")


@pytest.mark.parametrize("registers, warps, shared, arch, blocks", [
    (255, 8, 0, 90, 1),  # 8192 registers a warp (32 granules of 256): 8 warps fill the SM's 65536
    (128, 4, 0, 90, 4),  # 4096 a warp: 16 warps
    (100, 4, 0, 90, 4),  # 100 a thread is allocated as 104 (3328 a warp: 19 warps, not 20: 5 blocks)
    (32, 4, 100 * 1024, 90, 2),  # shared memory: 228 KiB over 100 + 1 reserved
    (32, 4, 100 * 1024, 80, 1),  # an A100's 164 KiB
    (32, 4, 113 * 1024, 90, 2),  # 2 * (113 + 1) = 228: fits only with the reserved KiB counted once a block
    (32, 32, 0, 90, 2),  # threads: 2048 over 1024
    (16, 1, 0, 90, 32),  # the SM's 32 blocks
])
def test_blocks_an_sm_holds(registers, warps, shared, arch, blocks):
    got = occupancy(registers, warps, shared, arch)
    assert got["blocks_per_sm"] == blocks
    assert got["occupancy"] == blocks * warps / 64


def row(**kw):
    return dict(dict(num_warps=4, blocks_per_sm=2, registers=128, tensor_flops=0, tensor_core=0, ffma=0,
                     local_bytes=0), **kw)


def launch(**kw):
    return dict(dict(programs=264, bytes=0, trips=0), **kw)


def test_a_kernel_time_by_hand():
    """264 programs of 4 warps, 2 blocks an SM: one wave on every SM at 8 warps resident (occupancy 1/8, half of
    ``OCCUPANCY_SATURATION``: half the bandwidth); 3.35 GB at 3.35 TB/s is 1 ms, over eta 0.5 and that half, 4 ms;
    10 serial iterations of 1 µs and a launch of 3 µs."""
    got = kernel_time(launch(bytes=3.35e9, trips=10), row(), eta=0.5, t_iter=1e-6)
    assert got["waves"] == 1 and got["sms_busy"] == 1 and got["occupancy"] == 8 / 64
    assert got["bound"] == "hbm_s" and math.isclose(got["hbm_s"], 1e-3)
    assert math.isclose(got["time_s"], 4e-3 + 10e-6 + H100["launch_s"])
    # spilled bytes: 1024 B a thread, 128 threads, 198 programs at L2's 5.5 TB/s; a block an SM: a full wave and a
    # second on half the SMs (busy 3/4), 4 warps resident (a quarter of the saturating 16)
    spill = kernel_time(launch(programs=198), row(local_bytes=1024, blocks_per_sm=1), eta=1.0, t_iter=0)
    assert spill["bound"] == "spill_s" and spill["waves"] == 2 and spill["sms_busy"] == 0.75
    assert math.isclose(spill["spill_s"], 1024 * 128 * 198 / 5.5e12)
    assert math.isclose(spill["time_s"], spill["spill_s"] / (0.75 * 0.25) + H100["launch_s"])
    # 66 programs: half the SMs busy; FFMAs at the fp32 rate, 2 FLOPs each a thread
    half = kernel_time(launch(programs=66), row(ffma=1000, blocks_per_sm=1, num_warps=16), eta=1.0, t_iter=0)
    assert half["sms_busy"] == 0.5 and half["bound"] == "fp32_s"
    assert math.isclose(half["fp32_flops"], 1000 * 2 * 512 * 66)
    assert math.isclose(half["time_s"], half["fp32_s"] / 0.5 + H100["launch_s"])
    # an empty grid (a walk's ends when the walk is one segment): Triton launches nothing, no time, no launch cost
    empty = kernel_time(launch(programs=0, bytes=0, trips=0), row(), eta=0.5, t_iter=1e-6)
    assert empty["waves"] == 0 and empty["time_s"] == 0


class _Kernel:
    """What ``specialised`` reads of a JIT function: its ``fn``'s module and name."""
    def __init__(self, module, name):
        self.fn = type("fn", (), {})()
        self.fn.__module__, self.fn.__name__ = module, name


def test_the_recorded_specialisation_marks_what_the_jit_would():
    """From the launches at (B, N, H, D) = (16, 2048, 12, 64): the causal ``_outputs``' pointers, N, D, the packed
    head stride 3D = 192 and B*H = 192 divisible by 16, H = 12 not; the moment scales' (and fold's) G = 1 a
    constant; a kernel no recorded step launches: its pointers only. Triton's attrs: the argument's index,
    ``tt.divisibility`` 16."""
    from dev.perf.kernel_resources import _attrs, specialised
    types = {"q_ptr": "*fp16", "BH": "i32", "H": "i32", "N": "i32", "SQK": "i32", "scale": "fp32", "BC": "constexpr"}
    how, divisible, constants = specialised(_Kernel("linattn.ops.triton.lln_causal", "_outputs"), {}, 64, types)
    assert how == "launch" and divisible == ["q_ptr", "BH", "N", "SQK"] and constants == {}
    how, _, constants = specialised(_Kernel("linattn.ops.triton.moment_match", "_scales"), {}, 64, {"G": "i32"})
    assert how == "launch" and constants == {"G": 1}
    assert specialised(_Kernel("nowhere", "_k"), {}, 64, types)[:2] == ("pointers", ["q_ptr"])
    assert _attrs(types, ["BH", "N"]) == {(1,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]}


def test_launches_record_the_jit_s_specialisation():
    """A causal LLN step at a small shape under the interpreter: each launch's grid and arguments, N = 128 and
    D = 32 divisible by 16, H = 2 not, the half pointers aligned."""
    from dev.perf.launches import record
    launches = record("lln", True, n=128, batch=2, heads=2, embed=64)
    outputs = next(x for x in launches if x["function"].endswith("lln_causal._outputs"))
    assert outputs["grid"] == [2, 4, 1] and outputs["options"]["num_warps"] == 4  # LAUNCH's at D = 32
    assert outputs["args"]["N"] == dict(value=128, type="i32", spec="D")
    assert outputs["args"]["H"]["spec"] == "" and outputs["args"]["q_ptr"]["spec"] == "D"
    assert outputs["args"]["q_ptr"]["tensor"]["shape"] == [2, 2, 128, 32]


def test_the_predicted_table_covers_every_measured_row():
    """docs/benchmarks/predicted_h100.json: the model's constants, the calibration against every fused fp16 row of
    the measured table (with its error), and a prediction with its kernels for every target series and N."""
    from linattn_tools.benchmark.targets import SIZES, TARGETS
    predicted = json.loads((ROOT / "docs/benchmarks/predicted_h100.json").read_text())
    measured = json.loads((ROOT / "docs/benchmarks/gpu_targets_h100.json").read_text())
    assert {"commit", "triton", "gpu", "eta", "t_iter_s", "calibration", "predictions"} <= set(predicted)
    fused = {(r["method"], r["causal"], r["n"]) for r in measured["runs"]["fused_chunk_parallel"]["rows"]
             if r["dtype"] == "float16" and r["impl"] == "fused"}
    calibrated = {(r["method"], r["causal"], r["n"]): r for r in predicted["calibration"]["rows"]}
    assert set(calibrated) == fused
    for r in calibrated.values():
        assert math.isclose(r["error"], r["predicted_s"] / r["measured_s"] - 1)
    rows = {(p["method"], p["causal"], p["n"]): p for p in predicted["predictions"]}
    assert set(rows) == {(m, c, n) for m, c in TARGETS for n in SIZES}
    for p in rows.values():
        assert p["kernels"] and p["predicted_s"] >= p["host_s"]
        assert math.isclose(p["device_s"], sum(k["time_s"] for k in p["kernels"]) + p["other_s"])
        assert p["other_s"] < p["floor_s"] <= p["device_s"]
        assert math.isclose(p["floor_ratio"], p["floor_s"] / p["softmax_s"])
        for k in p["kernels"]:
            assert {"function", "grid", "bytes", "tensor_flops", "fp32_flops", "spill_bytes", "blocks_per_sm",
                    "waves", "occupancy", "time_s"} <= set(k)


def targets_launches(predicted: dict, d: int) -> set:
    """(LAUNCH key, causality, programs) of every launch of the targets' steps at head size d: the predicted steps'
    at 64, the grids kept at 128."""
    if d == 64:
        return {(k["key"], k["causal"], k["programs"]) for p in predicted["predictions"] for k in p["kernels"]}
    return {(k["key"], k["causal"], k["programs"]) for g in predicted["grids_128"] for k in g["launches"]}


@pytest.mark.parametrize("d", [64, 128])
def test_the_targets_kernels_spill_nothing_and_share_their_sms(d):
    """The issue's proxies at the targets' shapes (fp16 and bf16, the sm_90 binaries of both Tritons on record): no
    kernel of a step spills, and each whose grid is more than two waves of one block an SM holds two or more blocks
    an SM, but those ``ONE_BLOCK_AN_SM`` records with its reason (a ledger that only shrinks)."""
    from dev.perf.kernel_resources import ONE_BLOCK_AN_SM
    predicted = json.loads((ROOT / "docs/benchmarks/predicted_h100.json").read_text())
    sms = predicted["gpu"]["sms"]
    launches = targets_launches(predicted, d)
    assert {g["d"] for g in predicted["grids_128"]} == {128} and len(launches) > 20
    spilled, crowded = {}, set()
    for triton in ("3.6", "3.9"):
        record = json.loads((ROOT / f"docs/benchmarks/kernel_resources_sm90_triton{triton}.json").read_text())
        rows = [r for r in record["rows"] if r["d"] == d and not r["change"]]
        for key, causal, programs in launches:
            own = [r for r in rows if r["kernel"] == key]  # the block softmax is built causal only
            built = [r for r in own if r["causal"] in (None, causal)] or own
            assert {r["dtype"] for r in built} == {"fp16", "bf16"}, key
            spilled.update({(triton, r["dtype"], key): r["spill_bytes"] for r in built if r["spill_bytes"]})
            if programs > 2 * sms and min(r["blocks_per_sm"] for r in built) < 2:
                crowded.add(key)
    assert spilled == {}
    assert crowded == set(ONE_BLOCK_AN_SM[d])


def test_a_walk_s_serial_steps():
    """A walk over NC = 512 chunks: all of them in one program; in segments of 32, a step a segment before its own
    and its 32 chunks (47), or the 32 of a segment's end; any other kernel none."""
    from dev.perf.predict import walk_trips

    def call(function="linattn.ops.triton.lln_causal._states", ends=None, **args):
        return dict(function=function, constexprs={"ENDS": ends}, args={k: {"value": v} for k, v in args.items()})
    assert walk_trips(call(NC=512)) == 512
    assert walk_trips(call(NC=512, SEG=32, ends=False)) == 47
    assert walk_trips(call(NC=512, SEG=32, ends=True)) == 32
    assert walk_trips(call("linattn.ops.triton.lln_causal._outputs", NC=512)) == 0

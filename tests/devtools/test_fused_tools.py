"""The fused kernels' GPU tools run here too: the traffic count and the targets' byte floors (meta device), the
profiler's table (CPU), the launch tuner's reference check and search (Triton's interpreter, tiny shapes)."""
import os

import pytest
import torch

from dev.perf import profile_step, traffic
from linattn_tools.benchmark.targets import TARGETS


def test_traffic_counts_the_fused_causal_step_below_half_the_parallel_one():
    """At (B, N) = (4, 1024) fp16 the fused causal LLN step moves under half the parallel one's bytes (its shifts
    in the kernels, no fp32 copies of q, k, v); each count covers the projections, so both exceed their bytes."""
    fused = traffic.step_traffic("lln", True, 1024, 4096, "float16", "fused")
    parallel = traffic.step_traffic("lln", True, 1024, 4096, "float16", "parallel")
    projections = 4 * 4096 * 768 * 2  # one pass over the four (tokens, 768) fp16 projections' outputs
    assert projections < fused["bytes"] < 0.5 * parallel["bytes"]
    assert fused["per_op"]["lln_causal"] > 0 and "lln_causal_backward" in fused["per_op"]
    assert fused["seconds"] == pytest.approx(sum(fused["per_op"].values()))


def test_traffic_counts_a_gather_and_an_in_place_scatter_by_the_rows_they_touch():
    """A gather reads as many of its input's elements as it writes, an in-place scatter reads and writes as many of
    its target's as its source holds (and both read the index, once where expanded): 8 rows of 1000 each, not all."""
    x = torch.empty(4, 1000, 64, dtype=torch.float16, device="meta")
    idx = torch.zeros(4, 8, 1, dtype=torch.long, device="meta").expand(4, 8, 64)  # a row index, as Skyformer's
    src = torch.empty(4, 8, 64, dtype=torch.float16, device="meta")
    with traffic._Traffic() as counter:
        x.gather(1, idx)
        x.scatter_add_(1, idx, src)
        x.index_add_(1, idx[0, :, 0], src)
        x.scatter_(1, idx, 1.0)
    rows = 4 * 8 * 64 * 2  # bytes of the 8 rows touched in each of the 4
    assert [r[:2] for r in counter.rows] == [("gather", 4 * 8 * 8 + 2 * rows), ("scatter_add_", 4 * 8 * 8 + 3 * rows),
                                             ("index_add_", 8 * 8 + 3 * rows), ("scatter_", 4 * 8 * 8 + 2 * rows)]


def test_traffic_counts_the_products_of_skyformers_inverse_kernels():
    """Skyformer's M^-1 kernels replace ~130 ``bmm``/``baddbmm`` ops whose FLOPs the count took: their own d×d×d and
    d×d×D products are counted for them (24 and 66 d³ a head, six steps), so the step's floor keeps the
    iteration's matmul time."""
    from linattn.ops.triton.nystrom_inverse import nystrom_inverse, nystrom_inverse_backward
    land = torch.empty(2, 3, 128, 64, device="meta")
    used = torch.empty(2, 128, device="meta")
    with traffic._Traffic() as counter:
        m_inv, tape = nystrom_inverse(land, used, 0.1)
        nystrom_inverse_backward(land, used, 0.1, tape, m_inv)
    rows = {row[0]: row for row in counter.rows}
    heads = 2 * 3
    assert {name: row[2] for name, row in rows.items()} == {
        "nystrom_inverse": 2 * heads * (24 * 128 ** 3 + 2 * 128 * 128 * 64),
        "nystrom_inverse_backward": 2 * heads * (66 * 128 ** 3 + 4 * 128 * 128 * 64)}
    assert rows["nystrom_inverse"][3] == torch.float32  # at the fp32 rate, as the ``bmm`` s were


def test_step_floors_count_every_fused_target_series_on_the_meta_device():
    res = traffic.step_floors(sizes=(512,), tokens=1024)
    assert set(res["floors"]) == {f"{m}{' causal' if c else ''}" for m, c in TARGETS}
    assert all(0 < f["512"] < 1 for f in res["floors"].values())


def test_profile_step_prints_the_step_table_on_the_cpu():
    text = profile_step.table("lln", True, 32, 64, "float32", "parallel", "cpu", steps=1, rows=5)
    head, bound = text.splitlines()[:2]
    assert head == "lln causal N=32 B=2 float32 impl parallel, 1 steps" and "aten::" in text
    wall, host, busy = (float(part.split(" ms")[0].split()[-1]) for part in bound.split(", "))
    assert bound.startswith("step ") and 0 < busy and 0 < host <= wall  # the CPU computes as it issues


@pytest.mark.extended  # ~5 min under the interpreter
def test_tune_fused_checks_and_searches_under_the_interpreter(monkeypatch):
    """The tuner's float64 checks pass for every family and its greedy search keeps, per kernel, the best of the
    settings it timed, each checked first (here on CPU tensors, tiny shapes, one candidate a kernel of each family,
    tf32 and tf32x3 emulated)."""
    pytest.importorskip("triton", minversion="3.9")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dev.perf import tune_fused
    from linattn.ops.triton import lln_noncausal

    monkeypatch.setattr(lln_noncausal, "SPLIT_ROWS", lln_noncausal.SPLIT_ROWS)  # the search leaves its best there
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", "{}")  # and its best settings here: both restored after the test
    monkeypatch.setattr(tune_fused, "SHAPES", ((1, 70),))
    monkeypatch.setattr(tune_fused, "CHECK_N", 77)
    candidates = {"lln_causal_grads": [dict(num_warps=8)], "lln_noncausal_readout": [dict(num_warps=4)],
                  "block_softmax_backward": [tune_fused.TF32X3], "nystrom_readout": [tune_fused.TF32X3],
                  "lavo_local_grad": [tune_fused.EXACT]}
    monkeypatch.setattr(tune_fused, "CANDIDATES", candidates)
    monkeypatch.setattr(tune_fused, "SPLITS", (64,))
    cpu = torch.device("cpu")
    for family, causalities in (("lln", 2), ("block", 2), ("skyformer", 1), ("lavo", 2)):
        checks = tune_fused.check(torch.float16, cpu, family)
        assert all(r["out"] <= r["tolerance"] and r["grads"] <= r["grad_tolerance"] for r in checks)
        assert len(checks) == causalities
    best, rows = tune_fused.search(torch.float16, cpu, repeats=1)
    for kernel in candidates:
        timed = [r for r in rows if r["kernel"] == kernel]
        assert len(timed) == 2 and all(r["accurate"] for r in timed)
        assert best[kernel] == min(timed, key=lambda r: r["ms"])["settings"]

"""The benchmark scripts run end to end (--quick), and their helpers measure what they claim.

No timing assertions: only structure, budgets, and quantities with a known answer.
"""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from linattn_tools.benchmark import flops, measure, report, sweep

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

MODULES = {"benchmark_attention": "linattn_tools.benchmark.attention",
           "benchmark_model": "linattn_tools.benchmark.model"}


def run_script(name, tmp_path, *extra):
    out = tmp_path / f"{name}.json"
    plot = tmp_path / "img" / f"{name}.png"
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-m", MODULES[name], "--quick", "--json", str(out),
                           "--plot", str(plot), "--docs", str(doc), *extra],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), plot, doc


def all_ok(points):
    return {name: [r["status"] for r in rows if r["status"] != "ok"] for name, rows in points.items()}


@pytest.mark.extended
def test_attention_benchmark_quick_measures_every_op_and_writes_its_outputs(tmp_path):
    res, plot, doc = run_script("benchmark_attention", tmp_path)
    expected = {"softmax", "lln", "lln_diag", "block_softmax", "lavo", "skyformer", "kernelized",
                "softmax causal", "lln causal", "lln_diag causal", "block_softmax causal", "lavo causal"}
    assert set(res["points"]) == expected
    assert not any(all_ok(res["points"]).values())
    assert all(r["peak_bytes"] > 0 and r["median_s"] > 0 for rows in res["points"].values() for r in rows)
    assert len(res["load_start"]) == 3 and set(res["matmul_flops"]) == {"64", "128"}
    if platform.libc_ver()[0] == "glibc":  # measured with glibc's defaults, then timed again keeping freed memory
        assert res["machine"]["malloc"] is None
        keep = " ".join(f"{k}={v}" for k, v in measure.KEEP_FREED_MEMORY.items())
        assert res["machine"]["malloc_second_column"] == keep
        assert all(r["keep_median_s"] > 0 for rows in res["points"].values() for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = doc.read_text()
    assert "<!-- BEGIN attention results -->" in text and "img/benchmark_attention.png" in text
    assert all(f"| {name} |" in text for name in expected)
    # rendering again from the JSON replaces the section instead of appending a second one, and
    # writes the plot beside that document (img/), not over the repository's docs/img
    committed = (ROOT / "docs" / "img" / "benchmark_attention.png").read_bytes()
    plot.unlink()
    subprocess.run([sys.executable, "-m", MODULES["benchmark_attention"], "--from-json",
                    str(tmp_path / "benchmark_attention.json"), "--docs", str(doc)], check=True,
                   capture_output=True, env=ENV, timeout=300)
    assert doc.read_text().count("<!-- BEGIN attention results -->") == 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "img" / "benchmark_attention.png").read_bytes() == committed


@pytest.mark.extended
def test_attention_benchmark_isolates_each_series_with_its_own_keep_times(tmp_path):
    res, _, doc = run_script("benchmark_attention", tmp_path, "--isolate", "--methods", "softmax", "lln",
                             "--modes", "causal")
    assert set(res["points"]) == {"softmax causal", "lln causal"}
    assert res["series"]["lln causal"] == {"method": "lln", "causal": True}
    assert not any(all_ok(res["points"]).values()) and set(res["matmul_flops"]) == {"64", "128"}
    if platform.libc_ver()[0] == "glibc":
        assert all(r["keep_median_s"] > 0 for rows in res["points"].values() for r in rows)
    assert "| lln causal |" in doc.read_text()


def test_child_argv_drops_options_with_all_their_values():
    from linattn_tools.benchmark.cli import child_argv

    argv = ["--sizes", "64", "128", "--methods", "softmax", "lln", "--isolate", "--json", "x.json",
            "--docs=d.md", "--quick", "--fit-range", "4", "8"]
    assert child_argv(argv, ("--methods", "--json", "--docs"), ("--isolate",)) == \
        ["--sizes", "64", "128", "--quick", "--fit-range", "4", "8"]


@pytest.mark.extended
def test_model_benchmark_quick_trains_and_decodes_every_method(tmp_path):
    res, plot, doc = run_script("benchmark_model", tmp_path)
    assert set(res["train"]["points"]) == {"softmax", "lln", "lln_diag", "skyformer", "lavo"}
    assert set(res["decode"]["points"]) == {"softmax", "lln", "lavo"}
    assert not any(all_ok(res["train"]["points"]).values()) and not any(all_ok(res["decode"]["points"]).values())
    # decoding state: softmax keeps every key and value, LLN and LAVO a fixed-size state
    state = {m: [r["state_bytes"] for r in rows] for m, rows in res["decode"]["points"].items()}
    assert state["softmax"][1] > state["softmax"][0]
    assert state["lln"][0] == state["lln"][1] and state["lavo"][0] == state["lavo"][1]
    # cross-attention decoding: fairseq's softmax keeps the source's keys and values, LAVO its memory only
    cross = {m: [r["state_bytes"] for r in rows] for m, rows in res["cross"]["points"].items()}
    assert cross["softmax"][1] > cross["softmax"][0] and cross["lavo"][0] == cross["lavo"][1]
    assert plot.exists() and "<!-- BEGIN model results -->" in doc.read_text()
    assert "LAVO cross-attention decoding" in doc.read_text()
    if platform.libc_ver()[0] == "glibc":  # by default in the user's environment: glibc's own allocator
        assert res["machine"]["malloc"] is None and "glibc malloc defaults" in doc.read_text()


@pytest.mark.extended
def test_model_benchmark_remeasures_one_part_and_keeps_the_others(tmp_path):
    kept = {"config": {"train_sizes": [7], "batch": 1, "attention_dropout": 0.0, "min_repeats": 1, "train_repeats": 1,
                       "warmup": 1, "train_arch": "tiny"},
            "machine": measure.machine_info(torch.device("cpu")), "load_start": [0, 0, 0], "load_end": [0, 0, 0],
            "train": {"points": {"softmax": [{"n": 7, "status": "ok", "median_s": 1.5}]}, "matmul_flops": {}}}
    (tmp_path / "benchmark_model.json").write_text(json.dumps(kept))
    res, _, _ = run_script("benchmark_model", tmp_path, "--parts", "cross")
    assert res["train"] == kept["train"] and res["config"] == kept["config"]
    assert set(res["cross"]["points"]) == {"softmax", "lavo"} and "decode" not in res


def test_scaling_exponent_recovers_a_power_law():
    rows = [{"n": n, "status": "ok", "t": 3e-9 * n ** 1.7} for n in (512, 1024, 4096, 8192)]
    rows.append({"n": 16384, "status": "skipped"})
    assert report.scaling_exponent(rows, "t", 512, 16384) == pytest.approx(1.7)
    assert report.scaling_exponent(rows, "t", 8192, 16384) is None  # one point is not a fit


def test_sweep_stops_a_case_at_the_budget_and_marks_the_rest(monkeypatch):
    """Each call returns its own cost and the sweep's clock reads it: no wall-clock timing in the test."""
    monkeypatch.setattr(sweep.measure, "elapsed_seconds", lambda call, device: call())
    monkeypatch.setattr(sweep.measure, "matmul_flops_per_second", lambda device, repeats=1: 1e9)
    cases = {"linear": lambda n, _: (lambda: n * 1e-5),
             "quadratic": lambda n, _: (lambda: n * n * 2e-7)}
    res = sweep.run(cases, [100, 200, 400, 800], torch.device("cpu"), time_budget=0.05, memory_budget=2 ** 30,
                    repeats=1, min_repeats=1, measure_memory=False, log=lambda _: None)
    assert [r["status"] for r in res["points"]["linear"]] == ["ok"] * 4
    quad = res["points"]["quadratic"]
    # 2 ms, 8 ms, then 32 ms is within budget; 800 is predicted at 128 ms > 50 ms: skipped, not run
    assert [r["status"] for r in quad] == ["ok", "ok", "ok", "skipped"]
    assert quad[3]["note"].startswith("predicted")
    assert quad[2]["median_s"] == pytest.approx(0.032)


def test_cpu_peak_memory_sees_a_temporary_allocation():
    def fn():
        x = torch.ones(1024, 1024)  # 4 MiB, freed on return
        return float(x.sum())

    peak = measure.peak_memory_bytes(fn, torch.device("cpu"))
    assert 4 * 2 ** 20 <= peak < 5 * 2 ** 20


def test_flop_counts_follow_the_algorithms():
    opts = {"chunk_size": 64, "block_size": 64, "window": 64, "bases": 64, "landmarks": 128}
    n, d = 8192, 64
    assert flops.forward_flops("lln", n, d, causal=False, opts=opts) == 4 * n * d * (d + 1)
    assert flops.forward_flops("softmax", n, d, causal=False, opts=opts) == 2 * flops.forward_flops(
        "softmax", n, d, causal=True, opts=opts)
    lln_diag = flops.forward_flops("lln_diag", n, d, causal=True, opts=opts)
    assert lln_diag == flops.forward_flops("lln", n, d, causal=True, opts=opts) + 4 * n * 64 * d
    for method in ("lln", "block_softmax", "lavo"):  # linear methods: doubling N doubles the work
        assert flops.forward_flops(method, 2 * n, d, causal=True, opts=opts) == 2 * flops.forward_flops(
            method, n, d, causal=True, opts=opts)
    assert flops.training_flops("lln", n, 2, 3, d, causal=False, opts=opts) == 18 * 4 * n * d * (d + 1)


def test_write_section_replaces_only_its_own_block(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# title\n\nhand-written text\n")
    report.write_section(doc, "a", "first")
    report.write_section(doc, "b", "other")
    report.write_section(doc, "a", "second")
    text = doc.read_text()
    assert "hand-written text" in text and "second" in text and "other" in text and "first" not in text


def test_model_memory_tables_count_a_point_over_the_time_budget_whose_peak_was_measured():
    """An update over the time budget still had its memory measured: the memory table shows it (with the budget
    it exceeded) and the longest-N fit goes through it; a point skipped before running does not count."""
    from linattn_tools.benchmark import model as bm
    gib = 2 ** 30
    rows = [{"n": 4096, "status": "ok", "peak_bytes": 3 * gib, "state_bytes": gib, "median_s": 30.0},
            {"n": 8192, "status": "over budget", "peak_bytes": 6 * gib, "state_bytes": gib, "median_s": 310.0,
             "note": "310.0 s > 300 s budget"},
            {"n": 16384, "status": "skipped", "peak_bytes": None, "note": "over budget at N=8192"}]
    res = {"config": {"fit_budget_gib": 20.0, "attention_dropout": 0.0}, "train": {"points": {"softmax": rows}}}
    mem = bm.memory_rows(res["train"]["points"])["softmax"]
    assert [r["status"] for r in mem] == ["ok", "ok", "skipped"] and mem[1]["over"] == "310.0 s > 300 s budget"
    table = bm.longest_update_table(res)
    assert "7.00 GiB at 8192" in table and "| 16384 |" in table  # fit through 4096 and 8192: 4 + 3 GiB per 4096 tokens


def test_the_malloc_default_applies_only_on_the_cpu():
    """glibc's settings matter for CPU tensors only: on a GPU the benchmark neither restarts nor runs twice."""
    from linattn_tools.benchmark import attention, model

    assert attention.parse_args(["--device", "cpu"]).malloc == "both"
    assert attention.parse_args(["--device", "cuda"]).malloc == "default"
    assert attention.parse_args(["--device", "cuda", "--malloc", "keep"]).malloc == "keep"
    assert model.parse_args(["--device", "cpu", "--malloc", "keep"]).malloc == "keep"
    assert model.parse_args(["--device", "cuda"]).malloc == "default"


def test_parallel_targets_compare_each_op_with_sdpa_of_its_own_causality_at_16k():
    """The parallel implementation's run is judged by its own budgets (not the CPU speed-ups): peak memory over the
    SDPA series of the same causality at N = 16384, and op growth from 4096 to 16384."""
    from linattn_tools.benchmark.attention import targets

    def point(n, peak, ops):
        return {"n": n, "status": "ok", "median_s": 1.0, "peak_bytes": peak, "aten_ops": ops}
    res = {"config": {"impl": "parallel", "device": "cpu"},
           "series": {"softmax": {"method": "softmax", "causal": False},
                      "softmax causal": {"method": "softmax", "causal": True},
                      "lln": {"method": "lln", "causal": False},
                      "lln causal": {"method": "lln", "causal": True}},
           "points": {"softmax": [point(4096, 10, 30), point(16384, 100, 30)],
                      "softmax causal": [point(4096, 5, 30), point(16384, 50, 30)],  # causal SDPA: half the memory
                      "lln": [point(4096, 20, 90), point(16384, 250, 90)],  # 2.5× SDPA: met
                      "lln causal": [point(4096, 20, 90), point(16384, 200, 120)]}}  # 4× causal SDPA; ops grow
    got = {t["target"]: (t["measured"], t["met"]) for t in targets(res)}
    assert got["lln: peak memory ≤ 3× SDPA's at N=16384"] == ("2.50×", True)
    assert got["lln causal: peak memory ≤ 3× SDPA's at N=16384"] == ("4.00×", False)
    assert got["lln: ATen ops per call at N=16384 ≤ 1.25× those at N=4096"] == ("1.00×", True)
    assert got["lln causal: ATen ops per call at N=16384 ≤ 1.25× those at N=4096"] == ("1.33×", False)
    assert not any("softmax:" in t or "faster" in t for t in got)
    res["config"].update(impl="looped", fit_range=[4096, 16384], sizes=[4096, 16384])  # looped: judged by speed-ups
    assert any("faster than SDPA" in t["target"] for t in targets(res))


# -- the fused kernels' benchmarks: training dtype, tokens per step, the implementation each op ran --

def test_attention_benchmark_batch_follows_tokens_per_step():
    from linattn_tools.benchmark.attention import batch_size, parse_args
    args = parse_args(["--quick", "--tokens-per-step", "32768"])
    assert [batch_size(n, args) for n in (2048, 4096, 16384, 32768, 65536)] == [16, 8, 2, 1, 1]
    assert batch_size(4096, parse_args(["--quick", "--batch", "3"])) == 3


def test_targets_table_compares_each_series_with_softmax_of_its_causality():
    from linattn_tools.benchmark.targets import render

    def row(method, causal, n, ms, mib, impl="fused"):
        return {"method": method, "causal": causal, "n": n, "batch": 32768 // n, "dtype": "bfloat16", "impl": impl,
                "median_s": ms / 1e3, "peak_bytes": mib * 2 ** 20}
    rows = [row("softmax", False, 4096, 10, 100, "only"), row("softmax", True, 4096, 6, 100, "only"),
            row("lln", False, 4096, 5, 120), row("lln", True, 4096, 4, 200),
            row("lln_diag", False, 4096, 9, 140, "parallel")]
    text = render([{"machine": {"cpu": "x", "gpu": "H100", "torch": "2.11"}, "rows": rows}])
    assert "| lln | 0.50× ✓ (≤0.6) `fused` | 1.20× (✓ ≤1.5) |" in text
    assert "| lln causal | 0.67× ✗ (≤0.6) `fused` | 2.00× (✗ ≤1.5) |" in text  # against causal softmax
    assert "| lln_diag | 0.90× ✗ (≤0.8) `parallel` |" in text and "| skyformer | – | – |" in text
    assert "Measured on: H100, torch 2.11" in text
    floors = {"floors": {"lln": {"4096": 0.002}, "lln causal": {"4096": 0.003}, "lln_diag": {"4096": 0.004}}}
    text = render([{"machine": {"cpu": "x", "gpu": "H100", "torch": "2.11"}, "rows": rows}], floors)
    assert "| lln | 0.50× ✓ (≤0.6) `fused`, floor 40% |" in text and "`fused`, floor 75% |" in text
    assert "| lln_diag | 0.90× ✗ (≤0.8) `parallel` |" in text  # a parallel step is not judged by the fused floor
    assert "CUDA graph replay" not in text  # no point was replayed (a CPU run, or points measured before)


def test_targets_table_says_what_a_cuda_graph_replay_gains_or_why_a_step_was_not_captured():
    from linattn_tools.benchmark.targets import render

    def row(method, causal, ms, issue_ms, replay_ms, why=None):
        return {"method": method, "causal": causal, "n": 2048, "batch": 16, "dtype": "float16", "impl": "fused",
                "median_s": ms / 1e3, "issue_s": issue_ms / 1e3, "peak_bytes": 1,
                "replay_s": None if replay_ms is None else replay_ms / 1e3, "replay_why": why}
    rows = [row("softmax", True, 2.0, 0.5, 1.6), row("lln", True, 3.0, 2.7, 2.0),
            row("lavo", True, 2.5, 1.0, None, "RuntimeError: operation not permitted when stream is capturing")]
    text = render([{"machine": {"cpu": "x", "gpu": "H100", "torch": "2.11"}, "rows": rows}])
    assert "CUDA graph replay (float16): eager step / its replay (issue time / eager step)" in text
    assert "| softmax causal | 1.25× (0.25) |" in text and "| lln causal | 1.50× (0.90) |" in text
    assert "| lavo causal | not captured: RuntimeError: operation not permitted when stream is capturing |" in text
    assert "| lln | – |" in text


def test_a_step_off_cuda_is_not_replayed_and_says_why(monkeypatch):
    """The targets' points carry the replay's fields on every device; off CUDA no capture is tried."""
    from argparse import Namespace

    from linattn_tools.benchmark import graph_replay, targets

    calls = []
    assert graph_replay.replay_seconds(lambda: calls.append(1), torch.device("cpu"), 3) == (
        None, "CUDA graphs need a CUDA device; this step ran on cpu")
    assert calls == []
    monkeypatch.setattr(targets, "build", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(targets, "implementation_for", lambda *a, **k: "parallel")
    monkeypatch.setattr(targets, "step", lambda module, x, mask: calls.append(x.shape))
    monkeypatch.setattr(targets, "module_step_inputs", lambda n, **k: (torch.zeros(n, k["batch"], 1), None))
    monkeypatch.setattr(torch.nn.Linear, "head_dim", 8, raising=False)
    args = Namespace(device="cpu", dtype="float32", tokens_per_step=64, impl="parallel", warmup=1, repeats=2)
    got, run = targets.time_step("lln", True, 32, args)
    assert got["batch"] == 2 and len(calls) == 1 + 2 + 2 + 1  # warm-up, timed, issue, peak memory
    targets.replay(got, run, args)
    assert got["replay_s"] is None and got["replay_why"].startswith("CUDA graphs need a CUDA device")
    assert len(calls) == 6  # no capture tried


@pytest.mark.extended
def test_attention_benchmark_fused_in_half_names_the_implementation_each_op_ran(tmp_path):
    out = tmp_path / "a.json"
    proc = subprocess.run([sys.executable, "-m", MODULES["benchmark_attention"], "--quick", "--json", str(out),
                           "--methods", "softmax", "lln", "--impl", "fused", "--dtype", "float16",
                           "--tokens-per-step", "256", "--no-memory", "--malloc", "default"],
                          capture_output=True, text=True, timeout=600, env={**ENV, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {r["impl"] for r in res["points"]["lln causal"]} == {"fused"}
    assert {r["impl"] for r in res["points"]["softmax"]} == {"only"}
    assert [r["batch"] for r in res["points"]["lln"]] == [4, 2]  # 256 // 64, 256 // 128
    assert "lln causal: implementation fused" in proc.stdout and "TFLOP/s" in proc.stdout


@pytest.mark.extended
def test_gpu_bench_script_quick_writes_every_point_and_the_targets_table(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "--quick", "--profile", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["float32_32.json", "float32_64.json"]
    left_out = json.loads((tmp_path / "float32_32.json").read_text())["left_out"]
    assert "fla-core's kernels run on CUDA GPUs only" in left_out["fla_linear"]  # the baseline, on a GPU
    for name in ("profile_lln.txt", "profile_lln_causal.txt", "profile_lavo_causal.txt", "profile_skyformer.txt",
                 "profile_lln_diag.txt"):
        assert "Self CPU" in (tmp_path / name).read_text()
    table = (tmp_path / "targets.md").read_text()
    assert "| lln causal |" in table and "| skyformer |" in table and "SDPA" in proc.stdout

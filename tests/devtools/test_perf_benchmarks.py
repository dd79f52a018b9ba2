"""The developer benchmarks of ``dev.perf`` that run on the CPU: an earlier commit's ops against this tree's
(``compare_ops``) and ``--attention-compile`` against eager (``compile``), run end to end from the repository's root.

No timing assertions: only structure and quantities with a known answer.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from linattn_tools.benchmark import measure

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.extended  # ~12 s: a commit's ops checked out and timed; a developer's tool
def test_compare_ops_times_a_commits_ops_against_the_tree_and_writes_its_section(tmp_path):
    """python -m dev.perf.compare_ops against HEAD's own ops: every case measured on both sides,
    the section written."""
    out, doc = tmp_path / "cmp.json", tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-m", "dev.perf.compare_ops", "--baseline", "HEAD",
                           "--sizes", "64", "--repeats", "1", "--malloc", "default", "--json", str(out),
                           "--docs", str(doc), "--section", "ops"],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["op"] for r in res["rows"]] == ["lln", "lln causal", "lln_diag", "lln_diag causal", "lavo",
                                              "lavo causal", "skyformer"]
    for r in res["rows"]:
        assert r["before_ms"] > 0 and r["after_ms"] > 0 and r["before_peak_mib"] > 0
        assert r["ratio"] == pytest.approx(r["after_ms"] / r["before_ms"])
    text = doc.read_text()
    assert "<!-- BEGIN ops -->" in text and "time at HEAD (ms)" in text and "no op slower than at HEAD" in text


@pytest.mark.extended
def test_compare_ops_in_fresh_processes_reports_the_median_and_range_over_them(tmp_path):
    """--processes 2: each point measured by two child processes; the row is their median, with the range."""
    out, doc = tmp_path / "cmp.json", tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "-m", "dev.perf.compare_ops", "--baseline", "HEAD",
                           "--sizes", "64", "--cases", "lln", "lavo causal", "--repeats", "1", "--processes", "2",
                           "--malloc", "default", "--json", str(out), "--docs", str(doc), "--section", "ops"],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["processes"] == 2 and [r["op"] for r in res["rows"]] == ["lln", "lavo causal"]
    for r in res["rows"]:
        assert r["processes"] == 2 and len(r["samples_s"]) == 2
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"] and r["before_peak_mib"] > 0
    assert "in each of 2 fresh processes per point" in doc.read_text() and " range |" in doc.read_text()


def test_compile_benchmark_renders_the_median_of_each_mode_and_their_ratio():
    from dev.perf import compile as compile_bench

    res = {"config": {"arch": "linattn_roberta_base", "repeats": 3}, "machine": measure.machine_info(
        torch.device("cpu")), "load_start": [0.0, 0.0, 0.0], "load_end": [0.0, 0.0, 0.0],
        "rows": [{"method": "lln", "n": 1024, "eager_first_s": 4.0, "compiled_first_s": 90.0, "graphs": 1,
                  "eager_s": [3.0, 9.0, 3.2], "compiled_s": [2.4, 2.5, 8.0]}]}  # medians 3.2, 2.5 (not means)
    text = compile_bench.render(res)
    assert "| LLN | 1024 | 3.20 | 2.50 | 0.78 | 4.0, 90.0 | 1 |" in text, text


@pytest.mark.extended
def test_compile_benchmark_quick_times_both_modes_in_one_graph(tmp_path):
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "-m", "dev.perf.compile", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["method"] == "lln" and row["graphs"] == 1
    assert len(row["eager_s"]) == len(row["compiled_s"]) == 1 and row["compiled_first_s"] > 0

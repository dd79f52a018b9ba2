"""scripts/gpu_selftest.sh: its no-GPU exit, and its checks run on the CPU (the GPU run itself is untested here)."""
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from linattn_tools.recipes import gpu_selftest

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_stops_at_once_with_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.time()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_selftest.sh"), "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == gpu_selftest.NO_GPU
    assert "no CUDA device" in gpu_selftest.NO_GPU and not (tmp_path / "w").exists()
    assert time.time() - start < 60


def test_help_says_what_it_does_and_how_long():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_selftest.sh"), "--help"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0
    for words in ("About 5 minutes", "float16", "bfloat16", "--fp16", "loss_scale", "4096", "PASS"):
        assert words in proc.stdout


def test_op_checks_pass_on_the_cpu_and_catch_a_wrong_op():
    cases = gpu_selftest.op_cases(2, 8)
    from linattn.methods import METHODS
    assert set(cases) == {f"{name} {role}" for name, m in METHODS.items() for role in m.roles}
    some = {name: cases[name] for name in ("softmax decoder", "lln encoder", "lavo decoder", "skyformer encoder",
                                            "lavo cross")}
    rows = gpu_selftest.check_ops("cpu", dtypes=("float32", "bfloat16"), heads=2, n=40, head_dim=8, cases=some)
    assert len(rows) == 10 and all(r["ok"] for r in rows), rows
    assert all(r["out_err"] < r["tol"] for r in rows)
    softmax = cases["softmax encoder"]

    def wrong(q, k, v, mask, ref=False):  # a kernel that drops the last key of every row
        out = softmax(q, k, v, mask, ref=ref)
        return out if ref else softmax(q, k[:, :, :-1], v[:, :, :-1], mask[:, :-1])

    def crash(q, k, v, mask, ref=False):
        if ref:
            return softmax(q, k, v, mask, ref=True)
        raise RuntimeError("no kernel image is available")

    def offset(q, k, v, mask, ref=False):  # a wrong output with the right gradients
        return softmax(q, k, v, mask, ref=ref) + (0 if ref else 0.01)

    bad = gpu_selftest.check_ops("cpu", dtypes=("float32",), heads=2, n=40, head_dim=8,
                                 cases={"wrong": wrong, "crash": crash, "offset": offset})
    assert [r["ok"] for r in bad] == [False, False, False] and bad[0]["out_err"] > 1e-3
    assert bad[1]["error"].startswith("RuntimeError: no kernel image")
    assert bad[2]["grad_err"] < 1e-6 < 1e-3 < bad[2]["out_err"]


def write_run(tb: Path, losses, scales, sub: str = "train_inner") -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb / sub))
    for step, (loss, scale) in enumerate(zip(losses, scales), 1):
        writer.add_scalar("loss", loss, step)
        if scale is not None:
            writer.add_scalar("loss_scale", scale, step)
    writer.close()


def test_training_is_judged_from_loss_and_loss_scale_in_tensorboard(tmp_path):
    write_run(tmp_path / "good", [9.0, 8.5, 8.0, 7.0], [128, 64, 64, 64])
    write_run(tmp_path / "good", [1e9], [2.0 ** -9], sub="valid")  # not a per-update record
    good = gpu_selftest.judge_training(tmp_path / "good", min_loss_scale=1.0)
    assert good["ok"] and good["updates"] == 4 and good["min_loss_scale"] == 64 and good["scale_drops"] == 1
    assert good["first_loss"] == 9.0 and good["last_loss"] == 7.0
    write_run(tmp_path / "collapse", [9.0] * 9, [2.0 ** -i for i in range(9)])
    collapse = gpu_selftest.judge_training(tmp_path / "collapse", min_loss_scale=1.0)
    assert not collapse["ok"] and "loss scale fell" in collapse["problem"] and collapse["scale_drops"] == 8
    write_run(tmp_path / "nan", [9.0, math.nan], [128, 128])
    assert gpu_selftest.judge_training(tmp_path / "nan", 1.0)["problem"] == "non-finite loss"
    write_run(tmp_path / "fp32", [9.0, 8.0], [None, None])
    assert "no loss or loss_scale" in gpu_selftest.judge_training(tmp_path / "fp32", 1.0)["problem"]


@pytest.mark.slow  # runs the sample recipes (fairseq-train)
def test_training_runs_the_sample_recipes_and_reads_their_tensorboard(tmp_path):
    # on the CPU the recipes drop --fp16, so there is a loss but no loss_scale: the run is judged failed
    for kind, attention in (("encoder", "lln_diag"), ("lm", "lavo")):
        row = gpu_selftest.run_training(kind, attention, tmp_path, updates=3, min_loss_scale=1.0, device="cpu")
        assert row["updates"] == 3 and math.isfinite(row["last_loss"]), Path(row["log"]).read_text()[-3000:]
        assert not row["ok"] and row["problem"].startswith("no loss or loss_scale")
        assert "--max-update 3" in Path(row["log"]).read_text() and row["run"] == f"{kind} {attention}"


@pytest.mark.slow  # ~1 min on 2 cores
def test_benchmark_runs_every_series_at_the_size_and_leaves_the_docs_alone(tmp_path):
    docs = [ROOT / "docs" / "benchmarks" / "attention.json", ROOT / "docs" / "img" / "benchmark_attention.png"]
    before = [p.stat().st_mtime_ns for p in docs if p.exists()]
    rows = gpu_selftest.run_benchmark(tmp_path, 128, device="cpu")
    assert len(rows) == 12 and all(r["ok"] and r["ms"] > 0 for r in rows), rows  # 7 non-causal + 5 causal
    assert {"lavo causal", "skyformer", "kernelized"} <= {r["series"] for r in rows}
    assert (tmp_path / "benchmark_attention.json").is_file()
    assert [p.stat().st_mtime_ns for p in docs if p.exists()] == before


def test_summary_line_passes_only_when_every_check_passed():
    ops = [{"op": "lln", "dtype": "float16", "ok": True}, {"op": "lavo", "dtype": "bfloat16", "ok": True}]
    train = [{"run": "encoder lln", "ok": True}]
    line = gpu_selftest.summary_line({"ops": ops, "fp16 training": train}, 12.3)
    assert line == "gpu_selftest: PASS (ops 2/2, fp16 training 1/1) in 12 s"
    ops[1]["ok"] = False
    line = gpu_selftest.summary_line({"ops": ops, "fp16 training": train}, 12.3)
    assert line.startswith("gpu_selftest: FAIL (ops 1/2,") and line.endswith("failed: lavo bfloat16")
    assert gpu_selftest.summary_line({"ops": []}, 1).startswith("gpu_selftest: FAIL")  # nothing ran
    assert "\n" not in line

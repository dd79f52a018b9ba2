"""scripts/gpu_selftest.sh: its no-GPU exit, its checks on the CPU (each shown to catch a broken case), its report,
and (slow) the whole ``--device cpu --quick`` run, then its stages that use --work again into the same --work."""
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from linattn_tools.recipes.selftest import compiled, core, ops, speed, training
from linattn_tools.recipes.selftest.env import no_cuda_message, torch_build

SCRIPT = str(ROOT / "scripts" / "gpu_selftest.sh")


def test_without_a_gpu_it_stops_at_once_naming_the_torch_build(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.time()
    proc = subprocess.run(["bash", SCRIPT, "--work", str(tmp_path / "w")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and not (tmp_path / "w").exists()
    assert proc.stderr.strip() == no_cuda_message() and "\n" not in proc.stderr.strip()
    assert f"{torch_build()}" in proc.stderr and torch.__version__ in proc.stderr
    if torch.version.cuda is None:  # this machine: the CPU-only wheel
        assert f"torch.version.cuda is None: the installed torch is a CPU-only wheel {torch.__version__}" in proc.stderr
    assert "--device cpu --quick" in proc.stderr and time.time() - start < 60


def test_help_names_every_stage_and_the_report():
    proc = subprocess.run(["bash", SCRIPT, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for words in (*core.STAGES, "report.md", "report.json", "--device cpu --quick", "loss_scale", "16384", "PASS"):
        assert words in proc.stdout, words


def quick_sizes():
    return {**ops.SIZES[True], "draws": 16}


def run_case(module, name="case", dtypes=("float32",), dropout_module=None):
    stage = core.Stage("ops")
    ops.check_case(stage, name, module, core.Settings("cpu", Path(".")), dtypes, "looped", quick_sizes(),
                   dropout_module=dropout_module)
    return {r.check[len(name) + len(" looped "):]: r for r in stage.rows}


def test_op_rows_pass_on_the_cpu_for_every_kind_of_case():
    cases = ops.build_cases(2, 8, "looped")
    from linattn.methods import METHODS
    assert set(cases) == {f"{name} {role}" for name, m in METHODS.items() for role in m.roles}
    dropped = ops.build_cases(2, 8, "looped", dropout=ops.DROPOUT)
    for name in ("softmax decoder", "lln encoder", "lln_diag decoder", "skyformer encoder", "lavo cross"):
        rows = run_case(cases[name], name, ("float32", "bfloat16"), dropped[name])
        assert all(r.status == "PASS" for r in rows.values()), [r for r in rows.values() if r.status != "PASS"]
        stats = {"lln encoder": "train float32 statistics", "lln_diag decoder": "train bfloat16 statistics"}
        assert stats.get(name, "eval float32") in rows
        if name == "skyformer encoder":
            assert rows["train draws"].measured == "redrawn per call: device yes"
        if name == "softmax decoder":
            assert rows[f"train dropout {ops.DROPOUT}"].detail.startswith("dropout acts")


class Broken(torch.nn.Module):
    """A case wrapping a real module with one fault, to show the rows catch it."""

    def __init__(self, inner, fault):
        super().__init__()
        self.inner, self.fault = inner, fault
        self.method, self.uses_keys = inner.method, inner.uses_keys

    @property
    def dropout(self):
        return self.inner.dropout

    @dropout.setter
    def dropout(self, p):
        self.inner.dropout = p

    def reference(self, *args):
        return self.inner.reference(*args)

    def attend(self, q, k, v, mask):
        if self.fault == "no fold" and q.dtype != torch.float64:  # the device's training forward folds nothing
            kept = {name: b.clone() for name, b in self.inner.named_buffers()}
            out = self.inner.attend(q, k, v, mask)
            for name, b in self.inner.named_buffers():
                b.copy_(kept[name])
            return out
        out = self.inner.attend(q, k, v, mask)
        if self.fault == "train offset" and self.training and q.dtype != torch.float64:
            return out + 0.01
        if self.fault == "eval offset" and not self.training:
            return out + 0.01
        if self.fault == "no rescale" and self.inner.dropout:  # dropout without the 1 / (1 - p)
            return out * (1 - self.inner.dropout)
        if self.fault == "shared mask" and self.inner.dropout:  # every call draws the same dropout mask
            torch.manual_seed(0)
            return self.inner.attend(q, k, v, mask)
        if self.fault == "drop keys":
            return self.inner.attend(q, k[:, :, :-1], v[:, :, :-1], mask[:, :-1])
        return out


@pytest.mark.parametrize("fault, row", [("eval offset", "eval float32"), ("drop keys", "eval float32"),
                                        ("train offset", "train float32"), ("no fold", "train float32 statistics"),
                                        ("no rescale", f"train dropout {ops.DROPOUT}"),
                                        ("shared mask", f"train dropout {ops.DROPOUT}")])
def test_op_rows_catch_a_broken_case(fault, row):
    name = "lln encoder" if fault == "no fold" else "softmax encoder"
    module = Broken(ops.build_cases(2, 8, "looped")[name], fault)
    dropped = Broken(ops.build_cases(2, 8, "looped", dropout=ops.DROPOUT)[name], fault)
    rows = run_case(module, dropout_module=dropped)
    assert rows[row].status == "FAIL", rows[row]
    assert [r for r, v in rows.items() if v.status == "FAIL"] == [row]


def test_a_crashing_case_fails_its_rows_and_the_others_still_run():
    module = Broken(ops.build_cases(2, 8, "looped")["softmax encoder"], "crash")
    module.attend = lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel image is available"))
    rows = run_case(module)
    assert rows["eval float32"].status == rows["train float32"].status == "FAIL"
    assert rows["eval float32"].detail.startswith("RuntimeError: no kernel image")


def write_run(tb: Path, losses, scales=None, stats=None) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb / "train_inner"))
    for step, loss in enumerate(losses, 1):
        writer.add_scalar("loss", loss, step)
        if scales:
            writer.add_scalar("loss_scale", scales[step - 1], step)
        for tag, value in (stats or {}).items():
            writer.add_scalar(tag, value, step)
    writer.close()


def judge(out, cuda=False, updates=6, warmup=1):
    stage = core.Stage("train")
    settings = core.Settings("cuda" if cuda else "cpu", out.parent, min_loss_scale=1.0)
    training.judge_run(stage, "run", out, settings, updates, warmup)
    return {r.check: r for r in stage.rows}


def test_training_is_judged_from_this_runs_tensorboard(tmp_path):
    write_run(tmp_path / "good" / "tb", [9, 8.5, 8, 7.5, 7, 6.5], [128, 64, 64, 64, 32, 32], {"lln_alpha": 2.0})
    rows = judge(tmp_path / "good", cuda=True)
    assert rows["run loss falls"].status == rows["run loss scale after warm-up"].status == "PASS"
    assert rows["run loss scale after warm-up"].measured == "32"
    assert rows["run moment statistics finite"].status == "PASS"
    write_run(tmp_path / "collapse" / "tb", [9, 8.5, 8, 7.5, 7, 6.5], [128, 1, 0.5, 0.25, 0.25, 0.25])
    assert judge(tmp_path / "collapse", cuda=True)["run loss scale after warm-up"].status == "FAIL"
    write_run(tmp_path / "flat" / "tb", [9] * 6, None, {"lln_beta": math.nan})
    rows = judge(tmp_path / "flat")
    assert rows["run loss falls"].status == rows["run moment statistics finite"].status == "FAIL"
    assert rows["run loss scale"].status == "SKIP" and "fp32" in rows["run loss scale"].detail
    write_run(tmp_path / "softmax" / "tb", [9, 8, 7, 6, 5, 4])
    assert judge(tmp_path / "softmax")["run moment statistics"].status == "SKIP"


def test_a_second_run_into_the_same_directory_reads_only_its_own_events(tmp_path):
    """The rerun bug: a run's TensorBoard directory kept the previous run's events (twice the updates)."""
    work = tmp_path / "work"
    out = work / "train" / "lm_lln"
    write_run(out / "tb", [9, 8, 7, 6, 5, 4])
    (work / "samples").mkdir()
    (work / "report.md").write_text("old")
    core.clear_work(work)
    assert not (work / "train").exists() and not (work / "report.md").exists() and (work / "samples").is_dir()
    write_run(out / "tb", [9, 8, 7, 6, 5, 4])
    assert judge(out)["run loss falls"].status == "PASS"
    write_run(out / "tb", [9, 8, 7, 6, 5, 4])  # what a run without clearing would read
    assert judge(out)["run loss"].status == "FAIL"


def fake_point(ms, peak=None):
    """A targets point: {(method, causal): milliseconds}; peak bytes 100 each unless ``peak`` says otherwise."""
    return {"rows": [{"method": m, "causal": c, "median_s": t / 1e3, "peak_bytes": (peak or {}).get((m, c), 100),
                      "impl": "fused" if m == "lln" else "parallel"} for (m, c), t in ms.items()]}


def test_speed_judges_the_targets_only_on_cuda(monkeypatch):
    """The targets of linattn_tools.benchmark.targets at N = 16384 (LLN <= 0.2x the softmax module's time, LLN+Diag
    and LAVO <= 0.3x, memory <= 1.5x): a series over its time or its memory fails, on CUDA only; bf16 is measured
    only where the GPU has it."""
    ms = {("softmax", False): 10.0, ("softmax", True): 5.0, ("lln", False): 1.5, ("lln", True): 1.5,
          ("lln_diag", False): 2.5, ("lavo", True): 1.4, ("skyformer", False): 2.0}
    calls = []

    def point(settings, dtype, n):
        calls.append((dtype, n))
        return fake_point(ms, peak={("lln_diag", False): 160})

    monkeypatch.setattr(speed, "run_point", point)
    stage = speed.speed_stage(core.Settings("cuda", Path("/nonexistent"), bf16=False))
    rows = {r.check: r for r in stage.rows}
    assert calls == [("float16", 4096), ("float16", 16384)]
    assert rows["lln float16 N=16384"].status == "PASS" and "x0.15" in rows["lln float16 N=16384"].measured
    assert rows["lln causal float16 N=16384"].status == "FAIL"  # 0.3x > 0.2x
    diag = rows["lln_diag float16 N=16384"]
    assert diag.status == "FAIL" and "x0.25" in diag.measured and "peak x1.60" in diag.measured  # memory only
    assert rows["lavo causal float16 N=16384"].status == "PASS"  # 0.28x <= 0.3x
    assert rows["lln float16 N=16384"].detail == "implementation fused"
    assert rows["lln float16 N=4096"].status == "PASS"  # 0.15x <= 0.6x
    calls.clear()
    stage = speed.speed_stage(core.Settings("cpu", Path("/nonexistent"), quick=True))
    assert calls == [("float32", 64)] and {r.status for r in stage.rows} == {"INFO"}  # --quick: one point


def test_compile_stage_fails_a_case_that_does_not_compile_or_compiles_to_no_graph(monkeypatch):
    """Without a real compile (seconds, not minutes): a compiler that raises (no Triton) fails the case with its
    message; one that leaves the op eager (no Dynamo graph) passes the values and fails the graph count."""
    def broken(fn, **kwargs):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(torch, "compile", broken)
    stage = core.Stage("compile")
    compiled.check_case(stage, "lln", "decoder", "cpu")
    (row,) = stage.rows
    assert (row.check, row.status) == ("lln decoder compiles", "FAIL") and "triton" in row.detail

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    stage = core.Stage("compile")
    compiled.check_case(stage, "lln", "encoder", "cpu")
    rows = {r.check: r for r in stage.rows}
    assert rows["lln encoder output compiled vs eager"].status == "PASS"
    assert rows["lln encoder gradients compiled vs eager"].status == "PASS"
    assert rows["lln encoder Dynamo graphs"].status == "FAIL" and rows["lln encoder Dynamo graphs"].measured == "0"
    assert stage.status == "FAIL"

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda *a, **k: fn(*a, **k) * 1.001)  # a wrong kernel
    stage = core.Stage("compile")
    compiled.check_case(stage, "lln", "decoder", "cpu")
    rows = {r.check: r for r in stage.rows}
    assert rows["lln decoder output compiled vs eager"].status == "FAIL"
    assert rows["lln decoder gradients compiled vs eager"].status == "FAIL"
    assert compiled.cases(quick=True) == (("lln", "decoder", "parallel"), ("lln", "decoder", "fused"))
    assert compiled.cases(quick=True, device="cpu") == (("lln", "decoder", "parallel"),)
    every = set(compiled.cases(False))
    assert {("lavo", "decoder", "parallel"), ("skyformer", "encoder", "parallel"), ("softmax", "decoder", "parallel"),
            ("lln", "decoder", "fused"), ("lavo", "encoder", "fused"), ("skyformer", "encoder", "fused")} <= every
    assert not {("softmax", "decoder", "fused"), ("kernelized", "encoder", "fused")} & every  # no fused kernels


def test_compile_stage_runs_fused_cases_in_half_precision_or_says_why_not(monkeypatch):
    """A fused case compiles modules that run ``fused`` in float16 here (bfloat16 on a GPU with it; the kernels take
    half only), judged by the dtype's tolerances; where fused cannot run (the CPU without Triton's interpreter) the
    case is one SKIP naming why, not a failure. Small sizes and an eager "compiler": the wiring, in seconds."""
    monkeypatch.setitem(compiled.SIZES, False, dict(batch=2, heads=2, n=12, head_dim=16))
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    built = []
    build_pair = compiled.build_pair
    monkeypatch.setattr(compiled, "build_pair", lambda *a, **k: built.append(build_pair(*a, **k)) or built[-1])
    stage = core.Stage("compile")
    compiled.check_case(stage, "lln", "decoder", "cpu", "fused")
    rows = {r.check: r for r in stage.rows}
    assert rows["lln decoder fused float16 output compiled vs eager"].status == "PASS"
    assert rows["lln decoder fused float16 gradients compiled vs eager"].status == "PASS"
    assert rows["lln decoder fused float16 output compiled vs eager"].threshold == "<= 5.0e-03"  # not float32's
    assert rows["lln decoder fused float16 step time compiled vs eager"].detail.endswith("fused float16")
    for module in built[0]:
        assert module.config.attention_impl == "fused" and module.q_proj.weight.dtype == torch.float16
    assert compiled.case_dtype("fused", "cpu") == "float16" and compiled.case_dtype("parallel", "cuda") == "float32"

    monkeypatch.delenv("TRITON_INTERPRET")
    stage = core.Stage("compile")
    compiled.check_case(stage, "lavo", "decoder", "cpu", "fused")
    (row,) = stage.rows
    assert (row.check, row.status) == ("lavo decoder fused float16 compiles", "SKIP") and "TRITON_INTERPRET" in \
        row.detail
    assert stage.status == "SKIP" and len(built) == 1


def test_compile_stage_checks_only_the_methods_asked_for(monkeypatch):
    seen = []
    monkeypatch.setattr(compiled, "check_case", lambda stage, *case: seen.append(case))
    monkeypatch.setattr(compiled, "compile_jobs", lambda count: 1)
    stage = compiled.compile_stage(core.Settings("cuda", Path("."), methods=("lavo",)))
    assert sorted(seen) == [("lavo", role, "cuda", impl) for role in ("decoder", "encoder")
                            for impl in ("fused", "parallel")]
    assert stage.note.startswith("lavo (--methods), encoder and decoder")
    seen.clear()
    compiled.compile_stage(core.Settings("cuda", Path(".")))
    assert len(seen) == len(compiled.cases(False)) == 17


def test_report_and_summary_pass_only_when_no_check_failed(tmp_path):
    ok, skip, info = core.Stage("ops"), core.Stage("multi_gpu"), core.Stage("speed")
    ok.judge("lln encoder looped eval float32", True, 1e-6, "<= 2e-04")
    skip.add("2 ranks", "SKIP", "1 GPU visible", ">= 2 GPUs")
    info.add("lln at N=128", "INFO", "1 ms")
    assert (ok.status, skip.status, info.status) == ("PASS", "SKIP", "INFO")
    settings = core.Settings("cpu", tmp_path)
    stages = [ok, skip, info]
    assert core.summary_line(stages, 3.2) == "gpu_selftest: PASS (ops PASS, multi_gpu SKIP, speed INFO) in 3 s"
    ok.judge("lavo decoder parallel train float16", False, 0.1, "<= 5e-03")
    line = core.summary_line(stages, 3.2)
    assert line.startswith("gpu_selftest: FAIL (ops FAIL,") and line.endswith("failed: ops: lavo decoder parallel "
                                                                             "train float16")
    md = core.write_report(settings, stages, {"torch": "x"}, 3.2).read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["status"] == "FAIL" and [s["status"] for s in data["stages"]] == ["FAIL", "SKIP", "INFO"]
    assert data["stages"][0]["rows"][1] == {"check": "lavo decoder parallel train float16", "status": "FAIL",
                                            "measured": "0.1", "threshold": "<= 5e-03", "detail": ""}
    assert "| ops | FAIL | 1/2 |" in md and "| lavo decoder parallel train float16 | FAIL | 0.1 | <= 5e-03 |" in md
    assert core.overall([]) == "FAIL"


# the second run: the stages that read or write --work besides the samples (the ops and compile stages write nothing)
RERUN_STAGES = ("train", "finetune", "eval_lm", "decode", "multi_gpu")


@pytest.mark.slow  # the whole self-test on the CPU once (~3 min, 2 cores)
def test_quick_cpu_selftest_passes_every_stage(tmp_path):
    run_quick_selftest(tmp_path / "w", runs=1)


@pytest.mark.extended  # the same, then its --work stages again into the same --work (~7 min, 2 cores)
def test_quick_cpu_selftest_reruns_into_the_same_work(tmp_path):
    run_quick_selftest(tmp_path / "w", runs=2)


def run_quick_selftest(work, runs: int):
    """``--device cpu --quick`` into ``work``: every stage passes (speed informs); a second run of the stages that
    use ``--work`` clears the first run's files and keeps its prepared samples."""
    for run, stages in ((1, core.STAGES), (2, ("env",) + RERUN_STAGES))[:runs]:
        start = time.time()
        choice = [] if run == 1 else ["--stages", *RERUN_STAGES]
        proc = subprocess.run(["bash", SCRIPT, "--device", "cpu", "--quick", "--work", str(work), *choice],
                              capture_output=True, text=True, timeout=900, env=core.child_env())
        assert proc.returncode == 0, (run, proc.stdout[-6000:], proc.stderr[-3000:])
        data = json.loads((work / "report.json").read_text())
        status = {s["name"]: s["status"] for s in data["stages"]}
        assert status == {s: {"speed": "INFO", "cuda_graph": "SKIP"}.get(s, "PASS") for s in stages}, status
        assert proc.stdout.strip().splitlines()[-1].startswith("gpu_selftest: PASS")
        rows = {r["check"]: r for s in data["stages"] for r in s["rows"]}
        lm = next(c for c in rows if c.startswith("lm ") and c.endswith(" loss falls"))
        assert rows[lm]["status"] == "PASS"  # this run's 6 updates, not both runs' 12
        assert rows["moment statistics rank 0 == rank 1"]["status"] == "PASS"
        if run == 1:
            prepared = (work / "samples" / "wikitext" / "bin" / ".done").stat().st_mtime_ns
            assert (work / "speed").is_dir()
        else:  # the first run's files are gone, its prepared samples kept
            assert (work / "samples" / "wikitext" / "bin" / ".done").stat().st_mtime_ns == prepared
            assert not (work / "speed").exists()
        print(f"run {run}: {time.time() - start:.0f} s; " + ", ".join(f"{s['name']} {s['seconds']:.0f} s"
                                                                   for s in data["stages"]))

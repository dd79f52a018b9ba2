"""What every stage shares: its settings, its result rows, the report (JSON + Markdown), the work directory, and
running a logged child process.

A stage returns a ``Stage``: rows of one measured number each, with the threshold it was judged by and a status:
PASS, FAIL, SKIP (not run here, and why) or INFO (reported without a verdict). A stage fails if any row fails.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[3]
STAGES = ("env", "ops", "compile", "cuda_graph", "train", "finetune", "eval_lm", "decode", "speed", "multi_gpu")
# what the self-test writes under --work, removed at the start of every run; prepared samples are kept
OUTPUTS = STAGES + ("report.json", "report.md")
SAMPLES = "samples"


@dataclass
class Settings:
    """One run's choices: ``device`` "cuda" or "cpu"; ``quick`` tiny sizes (the CPU test run)."""

    device: str
    work: Path
    quick: bool = False
    updates: int = 50
    min_loss_scale: float = 1.0
    bf16: bool = True  # native bfloat16 on the device (the env stage decides)
    gpus: int = 0
    methods: tuple = ()  # the ops and compile stages' methods (registry names); empty: every method

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def samples(self) -> Path:
        return self.work / SAMPLES

    def stage_dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL, SKIP, INFO
    measured: str = "—"
    threshold: str = "—"
    detail: str = ""


@dataclass
class Stage:
    name: str
    rows: List[Row] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0

    @property
    def status(self) -> str:
        statuses = {r.status for r in self.rows}
        if "FAIL" in statuses:
            return "FAIL"
        if "PASS" in statuses:
            return "PASS"
        return "INFO" if "INFO" in statuses else "SKIP"

    def add(self, check: str, status: str, measured="—", threshold="—", detail: str = "") -> Row:
        row = Row(check, status, fmt(measured), str(threshold), detail)
        self.rows.append(row)
        print(f"[{self.name}] {check}: {row.status} (measured {row.measured}; threshold {row.threshold})"
              + (f" {detail}" if detail else ""), flush=True)
        return row

    def judge(self, check: str, ok: bool, measured, threshold, detail: str = "") -> Row:
        return self.add(check, "PASS" if ok else "FAIL", measured, threshold, detail)


def fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def clear_work(work: Path) -> None:
    """Remove what an earlier run wrote under ``work`` (its stages' files, TensorBoard events, report); the
    prepared samples stay. Nothing else in ``work`` is touched."""
    for name in OUTPUTS:
        path = work / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def child_env(**extra: str) -> dict:
    """The environment of a child process: this repository first on PYTHONPATH, then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_logged(cmd: Sequence[str], log: Path, env: Optional[dict] = None, timeout: float = 3600) -> int:
    """Run ``cmd`` from the repository root with its output (and the command line first) in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        try:
            return subprocess.run(list(map(str, cmd)), cwd=ROOT, env=env or child_env(), stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[selftest] timed out after {timeout:.0f} s\n")
            return 124


def tail(log: Path, lines: int = 3) -> str:
    """The last lines of a log, for a FAIL row's detail."""
    try:
        text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


def prepare_samples(settings: Settings) -> Optional[str]:
    """The shipped samples binarised into ``work/samples`` (kept between runs); an error message or None."""
    if (settings.samples / "wikitext" / "bin" / ".done").is_file():
        return None
    log = settings.work / "prepare_samples.log"
    code = run_logged([sys.executable, "-m", "linattn_tools.recipes.prepare_samples", "--out", settings.samples], log)
    return None if code == 0 else f"preparing the samples failed (exit {code}; {log})"


def run_stage(name: str, fn, settings: Settings, *args) -> Stage:
    """``fn(settings, *args) -> Stage``, timed; an exception fails the stage with its message."""
    started = time.time()
    print(f"[gpu_selftest] stage {name}", flush=True)
    try:
        stage = fn(settings, *args)
    except Exception as exc:  # a crash is a failure of that stage, reported, not the end of the self-test
        stage = Stage(name)
        stage.add("stage ran", "FAIL", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    stage.seconds = time.time() - started
    print(f"[gpu_selftest] stage {name}: {stage.status} in {stage.seconds:.0f} s", flush=True)
    return stage


def overall(stages: List[Stage]) -> str:
    return "FAIL" if any(s.status == "FAIL" for s in stages) or not stages else "PASS"


def summary_line(stages: List[Stage], seconds: float) -> str:
    """``gpu_selftest: PASS|FAIL (env PASS, ops PASS, ...) in S s``, naming the failed checks."""
    parts = ", ".join(f"{s.name} {s.status}" for s in stages)
    failed = [f"{s.name}: {r.check}" for s in stages for r in s.rows if r.status == "FAIL"]
    tail_ = f"; failed: {'; '.join(failed[:8])}{' ...' if len(failed) > 8 else ''}" if failed else ""
    return f"gpu_selftest: {overall(stages)} ({parts}) in {seconds:.0f} s{tail_}"


def write_report(settings: Settings, stages: List[Stage], meta: dict, seconds: float) -> Path:
    """``work/report.json`` (everything) and ``work/report.md`` (a table per stage); returns the Markdown path."""
    data = {"status": overall(stages), "seconds": round(seconds, 1), "device": settings.device,
            "quick": settings.quick, **meta,
            "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 1), "note": s.note,
                        "rows": [asdict(r) for r in s.rows]} for s in stages]}
    (settings.work / "report.json").write_text(json.dumps(data, indent=1))
    lines = [f"# GPU self-test: {data['status']}", "",
             f"device {settings.device}{' (--quick)' if settings.quick else ''}; "
             + "; ".join(f"{k} {v}" for k, v in meta.items()) + f"; {seconds:.0f} s", "",
             "| stage | status | checks passed | seconds | note |", "|---|---|---|---|---|"]
    for s in stages:
        passed = sum(r.status == "PASS" for r in s.rows)
        judged = sum(r.status in ("PASS", "FAIL") for r in s.rows)
        lines.append(f"| {s.name} | {s.status} | {passed}/{judged} | {s.seconds:.0f} | {s.note} |")
    for s in stages:
        lines += ["", f"## {s.name}: {s.status}", ""] + ([s.note, ""] if s.note else [])
        lines += ["| check | status | measured | threshold | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r.check} | {r.status} | {r.measured} | {r.threshold} | {r.detail.replace('|', '/')} |"
                  for r in s.rows]
    path = settings.work / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

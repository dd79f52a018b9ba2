"""dev/gpu_lent.sh, the one prepared command for a lent GPU: its steps' options are the scripts' own, its caps keep
the whole within its budget (a step out of time is stopped, the next runs with what is left), and everything comes
back in $OUT. Run here in a copy whose steps are stand-ins."""
import shutil
import subprocess
import tarfile
from pathlib import Path

from helpers import ROOT

from linattn_tools.recipes.gpu_selftest import parse_args

SCRIPT = ROOT / "dev" / "gpu_lent.sh"


def test_its_steps_take_the_options_of_the_scripts_they_run():
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    assert list(steps) == ["setup (cap 120 s)", "ops (cap 120 s)", "graphs (cap 60 s)", "bench (cap 420 s)",
                           "compile (cap 150 s)"]
    bench = steps["bench (cap 420 s)"].split()
    assert bench[:2] == ["bash", "scripts/gpu_bench.sh"]
    accepted = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    assert all(f"    {opt})" in accepted for opt in bench if opt.startswith("--"))
    for name, stages, methods in (("ops (cap 120 s)", ["ops"], []), ("graphs (cap 60 s)", ["cuda_graph"], ["lln"]),
                                  ("compile (cap 150 s)", ["compile"], ["lln"])):
        command = steps[name].split()
        assert command[:2] == ["bash", "scripts/gpu_selftest.sh"]
        args = parse_args(command[2:])
        assert args.stages == stages and args.methods == methods
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "setup", "compile"], capture_output=True, text=True,
                          timeout=60)
    assert [line.split(" ")[0] for line in proc.stdout.strip().splitlines()] == ["setup", "compile"]


def _copy_with_stand_ins(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "dev").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / ".device-kit").mkdir()
    shutil.copy(SCRIPT, root / "dev" / "gpu_lent.sh")
    (root / ".device-kit" / "setup_gpu_env.sh").write_text("echo set up\n")
    (root / "scripts" / "gpu_bench.sh").write_text(
        'out=${@: -1}; mkdir -p "$out"; echo "| lln | 0.5x |" > "$out/targets.md"; sleep 30\n')
    (root / "scripts" / "gpu_selftest.sh").write_text(
        'w=${@: -1}; mkdir -p "$w"; echo "PASS $*" > "$w/report.md"\n')
    return root


def test_a_step_out_of_time_is_stopped_and_the_rest_still_runs_and_comes_back(tmp_path):
    root = _copy_with_stand_ins(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "WORK": str(work), "BUDGET": "4"}
    proc = subprocess.run(["bash", str(root / "dev" / "gpu_lent.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = (out / "steps.txt").read_text().splitlines()
    assert steps[0].startswith("setup: exit 0") and steps[1].startswith("ops: exit 0")
    assert steps[2].startswith("graphs: exit 0")
    assert steps[3].startswith("bench: exit 124")  # timeout's status
    assert "(cap 4 s)" in steps[3] or "(cap 3 s)" in steps[3]  # the budget's rest, not its own 420 s
    assert steps[4] == "compile: not run (no time left)" or steps[4].startswith("compile: exit 0")
    assert (out / "targets.md").read_text() == "| lln | 0.5x |\n"
    assert "--stages ops" in (out / "ops.md").read_text()
    assert "--stages cuda_graph --methods lln" in (out / "graphs.md").read_text()
    with tarfile.open(out / "gpu_lent.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./setup.log", "./ops.log", "./bench.log", "./steps.txt", "./bench/targets.md"} <= names

    env["BUDGET"] = "570"
    (root / "scripts" / "gpu_bench.sh").write_text('out=${@: -1}; mkdir -p "$out"; echo t > "$out/targets.md"\n')
    proc = subprocess.run(["bash", str(root / "dev" / "gpu_lent.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--stages compile --methods lln" in (out / "compile.md").read_text()
    assert [line.split(":")[0] for line in (out / "steps.txt").read_text().splitlines()] == \
        ["setup", "ops", "graphs", "bench", "compile"]
    proc = subprocess.run(["bash", str(root / "dev" / "gpu_lent.sh"), "setup", "compile"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in (out / "steps.txt").read_text().splitlines()] == ["setup", "compile"]


def test_without_the_device_kit_it_stops_at_once_saying_so(tmp_path):
    root = _copy_with_stand_ins(tmp_path)
    shutil.rmtree(root / ".device-kit")
    proc = subprocess.run(["bash", str(root / "dev" / "gpu_lent.sh")], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "no device kit" in proc.stderr and not (tmp_path / "out").exists()

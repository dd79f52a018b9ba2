"""The mutant list of ``python -m dev.mutation_check`` stays valid as the code changes, and the tool
kills a mutant end to end (in a copy of the repository: the working tree is left as it was)."""
import json
import os
import subprocess
import sys

from helpers import ROOT

from dev.mutants import MUTANTS
from dev.mutation_check import COVERED_DIRS, check_mutants, uncovered_files

CHEAP = "precision-autocast-on"  # its test file runs in seconds


def test_every_snippet_occurs_once_and_every_test_file_exists():
    assert check_mutants() == []


def test_at_least_forty_mutants_with_unique_ids():
    ids = [m.id for m in MUTANTS]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


def test_every_op_and_module_file_with_logic_has_a_mutant():
    assert uncovered_files() == [], f"files of {COVERED_DIRS} without a mutant"
    touched = {m.file for m in MUTANTS}
    assert {"fairseq_linattn/options.py", "fairseq_linattn/training_logs.py", "fairseq_linattn/fairseq_fixes.py",
            "linattn/ops/moment_matching.py"} <= touched
    assert any(f.startswith("fairseq_linattn/models/") for f in touched)


def test_a_changed_snippet_is_reported():
    m = MUTANTS[0]._replace(original="this text is in no file")
    assert check_mutants([m, MUTANTS[1], MUTANTS[1]]) == [
        f"{m.id}: the snippet occurs 0 times in {m.file} (must be once)", f"{MUTANTS[1].id}: duplicate id"]


def test_the_tool_kills_a_cheap_mutant_and_leaves_the_tree_alone(tmp_path):
    target = ROOT / next(m.file for m in MUTANTS if m.id == CHEAP)
    before = target.read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "dev.mutation_check", "--only", CHEAP, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["results"][0]["default"]["status"] == "killed", report
    assert report["summary"]["kill_rate_default"] == 1.0
    assert "default tier: 1/1 killed" in proc.stdout
    assert target.read_text() == before

"""Measure the test suite's strength: plant plausible one-line bugs, one at a time, and see which survive.

Every mutant of ``dev.mutants`` is applied to a *copy* of the repository (the three packages, tests,
data, docs, scripts, configs and the root config files, in a temporary directory per job), its relevant test
files run there with ``-x`` and PYTHONPATH set to the copy, and the file restored. The working tree is never
written, so an interrupted run leaves nothing behind. A test failure or error, a crash at import and a
timeout all count as killed; a mutant whose tests collect nothing is an error in the mutant list.

    python -m dev.mutation_check                     # every mutant, default tier, one job
    python -m dev.mutation_check --jobs 2 --json out.json
    python -m dev.mutation_check --only lln-output-grad-sign --tier both
    python -m dev.mutation_check --list

``--tier both`` runs the default tier's relevant tests and, for the survivors, the tests marked ``slow`` or
``extended`` too (in the mutant's ``slow`` files, else in all of ``tests/``). The tool exits 0 whatever survives
(it measures, it is not a test); it exits 2 for an invalid mutant list or arguments.
"""
import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[1]
COPIED_DIRS = ("linattn", "fairseq_linattn", "linattn_tools", "dev", "tests", "data", "docs", "scripts", "configs")
COPIED_FILES = ("pytest.ini", "ruff.toml", "setup.py", "README.md")
COVERED_DIRS = ("linattn/ops", "fairseq_linattn/modules")  # every file with logic here needs a mutant


def check_mutants(mutants: Sequence[Mutant] = MUTANTS, root: Path = ROOT) -> List[str]:
    """Problems of the mutant list against the code under ``root`` (empty: valid)."""
    problems, seen = [], set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: no file {m.file}")
            continue
        count = path.read_text().count(m.original)
        if count != 1:
            problems.append(f"{m.id}: the snippet occurs {count} times in {m.file} (must be once)")
        if m.original == m.replacement:
            problems.append(f"{m.id}: the replacement equals the snippet")
        if not m.tests:
            problems.append(f"{m.id}: no test files")
        problems += [f"{m.id}: no test file {t}" for t in m.tests + m.slow if not (root / t).is_file()]
    return problems


def uncovered_files(mutants: Sequence[Mutant] = MUTANTS, root: Path = ROOT) -> List[str]:
    """Files of ``COVERED_DIRS`` with logic (a ``def``; ``__init__.py`` aside) that no mutant touches."""
    touched = {m.file for m in mutants}
    files = []
    for d in COVERED_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.name != "__init__.py" and "def " in path.read_text() and rel not in touched:
                files.append(rel)
    return files


def copy_repository(dst: Path, root: Path = ROOT) -> None:
    """The files the tests need, copied from the working tree (uncommitted changes included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
    for d in COPIED_DIRS:
        if (root / d).is_dir():
            shutil.copytree(root / d, dst / d, ignore=ignore)
    for f in COPIED_FILES:
        if (root / f).is_file():
            shutil.copy2(root / f, dst / f)


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:160]
    lines = [x for x in output.splitlines() if x.strip()]
    return lines[-1][:160] if lines else ""


def run_tests(copy: Path, tests: Sequence[str], tier: str, timeout: float) -> Dict:
    """Run pytest on ``tests`` in ``copy``: {status: killed|survived|timeout|no-tests, seconds, detail}."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    if tier == "slow":  # the tiers beyond the default one: CI's end-to-end runs and the extended ones
        cmd += ["-m", "slow or extended"]
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds pytest and whatever it started
        proc.communicate()
        return {"status": "timeout", "seconds": time.monotonic() - t0, "detail": f"over {timeout:g} s"}
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        status = "survived"
    elif proc.returncode in (4, 5):  # usage error (a missing file) or no test collected: the list is wrong
        status = "no-tests"
    else:
        status = "killed"
    return {"status": status, "seconds": seconds, "detail": _first_failure(out)}


def _run_mutant(m: Mutant, copy: Path, tier: str, timeout: float) -> Dict:
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.original, m.replacement, 1))
    try:
        result = {"id": m.id, "file": m.file, "description": m.description, "tests": list(m.tests)}
        tiers = ("default", "slow") if tier == "both" else (tier,)
        for t in tiers:
            if t == "slow" and tier == "both" and result["default"]["status"] != "survived":
                break
            result[t] = run_tests(copy, (m.slow or ("tests",)) if t == "slow" else m.tests, t, timeout)
        return result
    finally:
        path.write_text(original)


def run_mutants(mutants: Sequence[Mutant], tier: str = "default", jobs: int = 1, timeout: float = 600.0,
                progress=None) -> List[Dict]:
    """Every mutant on its own, ``jobs`` at a time (one repository copy per job); results in the list's order."""
    todo: "queue.Queue[Mutant]" = queue.Queue()
    for m in mutants:
        todo.put(m)
    results: Dict[str, Dict] = {}
    lock = threading.Lock()

    def worker():
        with tempfile.TemporaryDirectory(prefix="linattn-mutants-") as tmp:
            copy = Path(tmp)
            copy_repository(copy)
            while True:
                try:
                    m = todo.get_nowait()
                except queue.Empty:
                    return
                r = _run_mutant(m, copy, tier, timeout)
                with lock:
                    results[m.id] = r
                    if progress:
                        progress(r, len(results), len(mutants))

    threads = [threading.Thread(target=worker) for _ in range(max(1, min(jobs, len(mutants))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[m.id] for m in mutants]


def _verdict(r: Dict, tier: str) -> str:
    return r[tier]["status"] if tier in r else "-"


def _killed(r: Dict, tier: str) -> bool:
    return _verdict(r, tier) in ("killed", "timeout")


def summary(results: Sequence[Dict]) -> Dict:
    """Kill rates of each tier that ran and, where the slow tier ran, of both tiers together (killed by either)."""
    no_tests = [r["id"] for r in results if "no-tests" in (_verdict(r, "default"), _verdict(r, "slow"))]
    valid = [r for r in results if r["id"] not in no_tests]
    out = {"mutants": len(results), "valid": len(valid), "no_tests": no_tests}
    for tier in ("default", "slow"):
        if any(tier in r for r in valid) and (tier == "default" or not any("default" in r for r in valid)):
            killed = sum(_killed(r, tier) for r in valid)
            out[f"killed_{tier}"], out[f"kill_rate_{tier}"] = killed, killed / len(valid)
    if any("slow" in r for r in valid):
        killed = sum(_killed(r, "default") or _killed(r, "slow") for r in valid)
        out["killed_both"], out["kill_rate_both"] = killed, killed / len(valid)
    out["survivors"] = [r["id"] for r in valid if not (_killed(r, "default") or _killed(r, "slow"))]
    return out


def table(results: Sequence[Dict]) -> str:
    rows = [("id", "file", "description", "default", "slow", "seconds")]
    for r in results:
        secs = sum(r[t]["seconds"] for t in ("default", "slow") if t in r)
        rows.append((r["id"], r["file"], r["description"][:60], _verdict(r, "default"), _verdict(r, "slow"),
                     f"{secs:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _select(only: Optional[Sequence[str]]) -> List[Mutant]:
    if not only:
        return list(MUTANTS)
    known = {m.id: m for m in MUTANTS}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise SystemExit(f"error: unknown mutant id(s): {', '.join(unknown)} (--list shows them)")
    return [known[i] for i in only]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dev.mutation_check",
                                description="Plant each mutant of dev/mutants.py in a copy of the "
                                            "repository, run its tests, report which survive.")
    p.add_argument("--tier", choices=("default", "slow", "both"), default="default",
                   help="default: the mutants' test files (default); slow: the tests marked slow or extended; "
                        "both: default, then those for the survivors")
    p.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    p.add_argument("--jobs", type=int, default=1, help="mutants run in parallel, one repository copy each")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant and tier (over: killed)")
    p.add_argument("--json", metavar="OUT", help="write the results and the kill rates to this JSON file")
    p.add_argument("--baseline", action="store_true",
                   help="first run the selected mutants' test files unmutated (they must pass)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        p.error("--jobs must be >= 1 and --timeout > 0")
    problems = check_mutants()
    if problems:
        print("the mutant list does not match the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    mutants = _select(args.only)
    if args.list:
        for m in mutants:
            print(f"{m.id:28s} {m.file:48s} {m.description}")
        return 0

    def progress(r, done, total):
        secs = sum(r[t]["seconds"] for t in ("default", "slow") if t in r)
        print(f"[{done}/{total}] {r['id']}: default {_verdict(r, 'default')}, slow {_verdict(r, 'slow')} "
              f"({secs:.1f} s) {r.get('default', {}).get('detail', '')}", flush=True)

    t0 = time.monotonic()
    if args.baseline:
        files = sorted({t for m in mutants for t in m.tests})
        with tempfile.TemporaryDirectory(prefix="linattn-mutants-") as tmp:
            copy_repository(Path(tmp))
            base = run_tests(Path(tmp), files, "default", args.timeout * len(files))
        print(f"baseline (no mutant, {len(files)} test files): {base['status']} in {base['seconds']:.0f} s "
              f"{base['detail']}", flush=True)
        if base["status"] != "survived":
            print("the unmutated tests do not pass: a mutant's kill would mean nothing", file=sys.stderr)
            return 2
    results = run_mutants(mutants, args.tier, args.jobs, args.timeout, progress)
    stats = summary(results)
    print()
    print(table(results))
    print()
    for key, label in (("default", "default tier"), ("slow", "slow tier"), ("both", "both tiers")):
        if f"kill_rate_{key}" in stats:
            rate = 100 * stats[f"kill_rate_{key}"]
            print(f"{label}: {stats[f'killed_{key}']}/{stats['valid']} killed ({rate:.1f} %)")
    print(f"survivors: {', '.join(stats['survivors']) or 'none'}")
    if stats["no_tests"]:
        print(f"error in the mutant list, no test collected: {', '.join(stats['no_tests'])}")
    print(f"{len(results)} mutants in {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": stats, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Completion markers: a step is done only when its marker exists and records the same parameters.

The marker is written last, after every output of the step is complete, so an interrupted step
(half-written files, a killed ``fairseq-preprocess``) is never taken as done and runs again.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

MARKER = ".done"


def _marker(out: Path) -> Path:
    return Path(out) / MARKER


def is_done(out: Path, params: dict) -> bool:
    """True if ``out`` holds a marker recording exactly ``params`` (JSON-comparable)."""
    marker = _marker(out)
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == json.loads(json.dumps(params))
    except ValueError:
        return False


def mark_done(out: Path, params: dict) -> None:
    """Write the marker atomically (temp file + rename)."""
    tmp = _marker(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(params, indent=1, sort_keys=True))
    os.replace(tmp, _marker(out))


def run_step(name: str, out: Path, params: dict, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` unless ``out`` is done with ``params``; then move tmp_dir to ``out``.

    ``build`` writes into an empty sibling directory that replaces ``out`` only when complete.
    """
    out = Path(out)
    if is_done(out, params):
        print(f"[prepare] {name}: done already ({out})", flush=True)
        return out
    print(f"[prepare] {name} -> {out}", flush=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    mark_done(out, params)
    return out


def write_lines(path: Path, lines: Iterable[str]) -> int:
    """Write lines (each without its newline) to ``path``; return how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
            n += 1
    return n

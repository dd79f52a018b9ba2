"""What every measuring module shares: where results go, and the envelope of a result file.

A result file is ``docs/reproduction/<group>.json``::

    {"group": ..., "command": the command that wrote it, "started": UTC time, "wall_s": seconds,
     "machine": benchmark.measure.machine_info, "load": [start, end load averages],
     "settings": what was measured and how, "results": the numbers}

Nothing in these files is edited by hand; the ledger's "holds" column is computed from them.
"""
import contextlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "docs" / "reproduction"
SETTINGS = ROOT / "configs" / "reproduce.yaml"


def settings(group: str) -> Tuple[Dict, Optional[Dict]]:
    """(full, quick) keyword arguments of a group's ``measure`` from configs/reproduce.yaml (lists as tuples)."""
    import yaml

    with open(SETTINGS) as f:
        entry = yaml.safe_load(f)[group]
    as_tuples = lambda d: None if d is None else {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return as_tuples(entry["full"]), as_tuples(entry.get("quick"))
LEDGER = ROOT / "docs" / "reproduction.md"
GROUPS = ("lln_distribution", "lln_cost", "quickstart", "skyformer_error", "skyformer_fig1", "decoding")


@contextlib.contextmanager
def torch_threads(count: int):
    """Run with ``count`` intra-op threads, then restore. The measurements use one: on this machine,
    shared with other jobs, a two-thread op waits for a descheduled thread at every parallel region
    (a 512 x 512 eigendecomposition took 250 s with two threads under a load of 6, 6 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def result_path(group: str, directory: Path = RESULTS_DIR) -> Path:
    return Path(directory) / f"{group}.json"


def run_group(group: str, command: str, settings: Dict, measure: Callable[[], Dict],
              directory: Path = RESULTS_DIR, wall_s: Optional[float] = None) -> Dict:
    """Call ``measure()``, wrap its results with the command, machine and load, write the JSON.

    ``wall_s``: the measurement's wall time when it ran earlier (a reused quick-start run)."""
    from ..benchmark.measure import load_average, machine_info

    started, t0, load_start = datetime.now(timezone.utc), time.perf_counter(), load_average()
    results = measure()
    record = {"group": group, "command": command, "started": started.strftime("%Y-%m-%d %H:%M UTC"),
              "wall_s": round(time.perf_counter() - t0 if wall_s is None else wall_s, 1),
              "machine": machine_info(torch.device("cpu")),
              "load": [load_start, load_average()] if wall_s is None else None,  # unknown for an earlier run
              "settings": settings, "results": results}
    path = result_path(group, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"[reproduce] wrote {path} ({record['wall_s']:.0f} s)", flush=True)
    return record

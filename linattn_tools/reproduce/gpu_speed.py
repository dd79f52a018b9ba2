"""The speed claims judged on a GPU run: a committed ``python -m linattn_tools.benchmark.model`` JSON.

LLN Table 2 and LAVO Tables 2 and 10 were measured on GPUs (an A100 for LAVO). This module finds,
among ``docs/benchmarks/*.json``, a model benchmark whose machine block names a CUDA device (the first
in name order; ``train`` and/or ``decode`` sections as the benchmark writes them) and hands the
ledger a record of it: ``{"group": "gpu_benchmark", "source": path or None, "machine", "config",
"train", "decode", "date"}``. Nothing is measured here (no GPU on the machine that renders the
ledger); with no such file the GPU rows say so and hold nothing.
"""
import json
import subprocess
from pathlib import Path
from typing import Dict, Optional

from .common import ROOT

BENCHMARKS = ROOT / "docs" / "benchmarks"


def _is_gpu_model_benchmark(data) -> bool:
    machine = data.get("machine") if isinstance(data, dict) else None
    return (isinstance(machine, dict) and str(machine.get("device", "")).startswith("cuda")
            and any(isinstance(data.get(part), dict) and "points" in data[part] for part in ("train", "decode")))


def _date(path: Path, data: Dict) -> str:
    for key in ("date", "started", "written"):
        if data.get(key):
            return str(data[key])
    try:  # the date the file was committed
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "date not recorded (file not committed yet)"


def record(directory: Path = BENCHMARKS) -> Dict:
    """The ledger's record of the first GPU model benchmark in ``directory`` (source None if there is none)."""
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _is_gpu_model_benchmark(data):
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            return {"group": "gpu_benchmark", "source": str(rel), "machine": data["machine"],
                    "config": data.get("config", {}), "train": data.get("train"), "decode": data.get("decode"),
                    "date": _date(path, data)}
    return empty()


def empty() -> Dict:
    return {"group": "gpu_benchmark", "source": None, "machine": None, "config": {}, "train": None,
            "decode": None, "date": None}


def describe(rec: Dict) -> Optional[str]:
    """"NVIDIA H100 80GB HBM3, float32, 2026-11-25": the card, the dtype and the date of the run."""
    if not rec.get("source"):
        return None
    m, c = rec["machine"], rec["config"]
    return f"{m.get('gpu', m.get('device'))}, {c.get('dtype', 'float32')}, {rec['date']}"

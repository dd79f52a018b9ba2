"""LLN Table 2 analogue: a RoBERTa-base training update's time and memory against N, per attention.

Most points come from the model benchmark already in the repository (``docs/benchmarks/model.json``,
``python -m linattn_tools.benchmark.model``: ``linattn_roberta_base``, B = 1, one masked-LM update with Adam,
attention dropout 0, and ``docs/benchmarks/model_attention_dropout.json``: softmax with RoBERTa's
attention dropout 0.1 at N = 2048). Attention dropout acts on softmax only (the linear methods form no
attention matrix), so the linear methods' points hold for either setting. What is missing for the
longest-sequence claim is softmax *with* dropout 0.1 at more lengths: with dropout, CPU SDPA
materialises the N x N probabilities, so its memory grows as N². This module runs the same benchmark
tool for it at N = 512 ... 1280 (each update stays below ~6 GiB on this shared machine; 2048
needs 8.3 GiB above the parameters and is taken from the committed file), with LLN and LLN+Diag
beside it, so that time ratios compare updates measured in one run, under the same machine load, on
one thread (two-thread updates on this shared machine waited for descheduled threads: 60 s instead
of 2 s at N = 512).

The memory of an update is the benchmark's peak above parameters and optimizer state plus that
state (parameters, Adam's two moments): what a device must hold. The fits and the longest N that
fits in a memory budget are computed from these points by ``claims`` when the ledger is rendered.
"""
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

from .common import RESULTS_DIR, ROOT, settings

BENCHMARK_MODULE = "linattn_tools.benchmark.model"
MODEL_JSON = ROOT / "docs" / "benchmarks" / "model.json"
DROPOUT_JSON = ROOT / "docs" / "benchmarks" / "model_attention_dropout.json"
RAW_JSON = RESULTS_DIR / "roberta_update_attention_dropout.json"
DEFAULTS, _ = settings("lln_cost")


def benchmark_command(sizes: Sequence[int], out: Path, plot: Path, quick: bool = False) -> List[str]:
    cmd = [sys.executable, "-m", BENCHMARK_MODULE, "--parts", "train", "--train-methods", *DEFAULTS["methods"],
           "--attention-dropout", "0.1", "--train-sizes", *map(str, sizes), "--train-repeats", "2",
           "--min-repeats", "2", "--threads", "1", "--json", str(out), "--plot", str(plot)]
    return cmd + (["--quick"] if quick else [])


def memory_budget_gib() -> int:
    """The memory budget of the longest-sequence claims: this machine's memory in whole GiB (the claims
    read it from the record's settings, so a ledger rendered elsewhere keeps the measuring machine's)."""
    from ..benchmark.measure import memory_bytes

    return round(memory_bytes() / 2 ** 30)


def run_softmax_dropout(sizes: Sequence[int], out: Path = RAW_JSON) -> None:
    """Measure softmax (attention dropout 0.1), LLN and LLN+Diag updates with the benchmark script into ``out``."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = benchmark_command(sizes, out, Path(tmp) / "plot.png")
        print("[lln_cost] " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)


def _points(path: Path, methods: Sequence[str], source: str) -> List[Dict]:
    res = json.loads(Path(path).read_text())
    dropout = res["config"]["attention_dropout"]
    out = []
    for method, rows in res["train"]["points"].items():
        if method not in methods:
            continue
        for r in rows:
            if r["status"] == "ok" and r.get("peak_bytes") is not None:
                out.append({"method": method, "attention_dropout": dropout, "n": r["n"], "seconds": r["median_s"],
                            "min_seconds": r.get("min_s", r["median_s"]),
                            "peak_bytes": r["peak_bytes"], "state_bytes": r["state_bytes"],
                            "total_bytes": r["peak_bytes"] + r["state_bytes"], "load": (r.get("load") or [None])[0],
                            "source": source})
    return out


def collect(methods: Sequence[str] = DEFAULTS["methods"], model_json: Path = MODEL_JSON,
            dropout_json: Path = DROPOUT_JSON, raw_json: Path = RAW_JSON) -> Dict:
    """Every point of the three benchmark files, labelled with its file (paths relative to the repository)."""
    points = []
    for path in (model_json, dropout_json, raw_json):
        if Path(path).is_file():
            points += _points(path, methods, str(Path(path).resolve().relative_to(ROOT)))
    arch = json.loads(Path(model_json).read_text())["config"]["train_arch"]
    return {"arch": arch, "points": points}

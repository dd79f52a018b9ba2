"""LLN Table 1 and LAVO Table 2 analogues, read from one run of the CPU quick-start.

``scripts/quickstart.sh`` (configs/quickstart.yaml) pretrains a tiny RoBERTa with softmax, LLN and
LLN+Diag for the same updates on the KJV sample, fine-tunes each on the ``kjv_testament``
classification sample, trains a tiny causal LM with softmax (sinusoidal positions), LLN and LAVO
(no token positions) and evaluates it at 1x, 1.5x and 2x its training context. Its fairseq logs and
``extrapolation.tsv`` files are read with ``recipes.report``; this module copies the numbers the
ledger needs into ``docs/reproduction/quickstart.json``.
"""
import os
import re
import subprocess
from pathlib import Path
from typing import Dict, Optional

from ..recipes import report
from .common import ROOT

RUN_DIR = ROOT / "runs" / "reproduction" / "quickstart"


def run_quickstart(run_dir: Path = RUN_DIR) -> None:
    env = {**os.environ, "RUN": str(run_dir)}
    print(f"[quickstart] RUN={run_dir} bash scripts/quickstart.sh", flush=True)
    subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], check=True, cwd=ROOT, env=env)


def _settings(run_dir: Path) -> Dict[str, str]:
    """The settings table at the top of REPORT.md (seed, updates, task, wall time, threads)."""
    out = {}
    report_md = run_dir / "REPORT.md"
    if report_md.is_file():
        for line in report_md.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 2 and cells[0] not in ("setting", "---") and not cells[0].startswith("-"):
                out[cells[0]] = cells[1]
            if line.startswith("## "):
                break
    return out


def reported_wall_seconds(run_dir: Path = RUN_DIR) -> Optional[float]:
    """The quick-start's own wall time from its REPORT.md ("wall time | 812 s (FAST=0)"), if there."""
    match = re.match(r"\s*([0-9.]+)\s*s", _settings(Path(run_dir)).get("wall time", ""))
    return float(match.group(1)) if match else None


def collect(run_dir: Path = RUN_DIR) -> Dict:
    """{"settings", "encoder": {attn: {mlm_train_loss, mlm_valid_loss, finetune_valid_loss,
    finetune_accuracy}}, "lm": {attn: {train_loss, valid_loss, contexts: [{context, ratio, ppl}]}}}."""
    run_dir = Path(run_dir)
    encoder, lm = {}, {}
    for attn, log in report._logs(run_dir / "pretrain").items():
        ft_path = run_dir / "finetune" / attn / "train.log"
        ft = report.read_log(ft_path) if ft_path.is_file() else {tag: [] for tag in report.TAGS}
        encoder[attn] = {"mlm_train_loss": report.last(log["train_inner"], "loss"),
                         "mlm_valid_loss": report.last(log["valid"], "loss"),
                         "mlm_updates": report.last(log["valid"], "num_updates"),
                         "finetune_valid_loss": report.last(ft["valid"], "loss"),
                         "finetune_accuracy": report.best(ft["valid"], "accuracy")}
    for attn, log in report._logs(run_dir / "lm").items():
        table = run_dir / "lm" / attn / "extrapolation.tsv"
        rows = report.read_extrapolation(table) if table.is_file() else []
        lm[attn] = {"train_loss": report.last(log["train_inner"], "loss"),
                    "valid_loss": report.last(log["valid"], "loss"),
                    "contexts": [{"context": int(r["context"]), "ratio": r["ratio"], "ppl": r["ppl"]} for r in rows]}
    if not encoder or not lm:
        raise FileNotFoundError(f"{run_dir} holds no finished quick-start run (pretrain/*/train.log, "
                                f"lm/*/extrapolation.tsv); run `RUN={run_dir} bash scripts/quickstart.sh`")
    return {"settings": _settings(run_dir), "encoder": encoder, "lm": lm}

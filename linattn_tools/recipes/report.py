"""Read fairseq training logs; write the GLUE summary and the quick-start's REPORT.md with plots.

    python -m linattn_tools.recipes.report glue --attention lln checkpoints/glue/*/lln
    python -m linattn_tools.recipes.report pg19 --checkpoint CKPT checkpoints/pg19/ATTN/extrapolation.tsv
    python -m linattn_tools.recipes.report quickstart runs/quickstart

Logs are what fairseq-train prints with ``--log-format json`` (the recipe scripts keep it in
``train.log``): lines ``... | valid | {json}``, or the bare JSON lines of its ``--log-file``. A record
is ``train_inner`` when its keys are bare (loss, num_updates) and ``train``, ``valid``, ``valid1``
when they carry that prefix (valid_loss, valid_num_updates).
Each table has a "paper" column beside ours with the published figure for that row (LLN Table 1 for
GLUE, LAVO Table 2 for PG-19 perplexity; ``paper_results``), "—" where the paper has none.
(It imports only ``paper_results`` beside it, no torch or fairseq.)
"""
import argparse
import csv
import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional

from . import paper_results

TAGS = ("train_inner", "train", "valid", "valid1")
GLUE_COLUMNS = {"mnli": "MNLI (m/mm)", "qnli": "QNLI", "qqp": "QQP", "sst2": "SST-2",
                "kjv_testament": "KJV testament", "kjv_next_verse": "KJV next verse"}


def _tag(record: dict) -> str:
    """train_inner records have a bare ``loss``; the others a prefixed one (valid_loss, valid1_loss, train_loss)."""
    for tag in ("valid1", "valid", "train"):
        if f"{tag}_loss" in record:
            return tag
    return "train_inner"


def run_logs(log_file: Path) -> List[Path]:
    """``train.log`` after the logs of the earlier runs into the same directory (``train.log.1``, ``.2``, ...:
    a rerun keeps them, see scripts/recipe_lib.sh), oldest first."""
    log_file = Path(log_file)
    earlier = [p for p in log_file.parent.glob(log_file.name + ".*") if p.suffix[1:].isdigit()]
    return sorted(earlier, key=lambda p: int(p.suffix[1:])) + [log_file]


def read_log(path: Path, *, with_earlier_runs: bool = False) -> Dict[str, List[dict]]:
    """{tag: [record, ...]} with numeric values as floats, in the order logged (repeated lines once);
    ``with_earlier_runs``: the earlier runs' logs first (``run_logs``), e.g. a fine-tuning resumed after a stop."""
    records: Dict[str, List[dict]] = {tag: [] for tag in TAGS}
    seen = set()
    paths = run_logs(path) if with_earlier_runs else [Path(path)]
    lines = [line for p in paths if p.is_file() for line in p.read_text(errors="replace").splitlines()]
    for line in lines:
        text = line[line.find("{"):] if "{" in line else ""
        if text in seen:  # fairseq's --log-file handler is added again at every epoch
            continue
        seen.add(text)
        try:
            raw = json.loads(text)
        except ValueError:  # fairseq's config dump and messages
            continue
        if isinstance(raw, dict):
            records[_tag(raw)].append({k: _number(v) for k, v in raw.items()})
    return records


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def curve(records: List[dict], key: str) -> List[tuple]:
    """[(num_updates, value)] of ``key`` (prefixed keys such as valid_loss are found too)."""
    out = []
    for record in records:
        value = next((record[k] for k in (key, f"valid_{key}", f"valid1_{key}", f"train_{key}") if k in record), None)
        updates = next((record[k] for k in ("num_updates", "valid_num_updates", "valid1_num_updates",
                                            "train_num_updates") if k in record), None)
        if isinstance(value, float) and updates is not None:
            out.append((int(updates), value))
    return out


def last(records: List[dict], key: str) -> Optional[float]:
    values = curve(records, key)
    return values[-1][1] if values else None


def best(records: List[dict], key: str) -> Optional[float]:
    values = [v for _, v in curve(records, key)]
    return max(values) if values else None


def read_extrapolation(path: Path) -> List[dict]:
    """Rows of eval_pg19.sh's extrapolation.tsv: context, ratio, loss_bits, ppl (as numbers)."""
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f, delimiter="\t")]


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def glue_accuracy(task: str, log: Dict[str, List[dict]]) -> str:
    """Best validation accuracy; MNLI as matched/mismatched, both of the best matched checkpoint."""
    if task == "mnli":
        matched = curve(log["valid"], "accuracy")
        if not matched:
            return "—/—"
        at, accuracy = max(matched, key=lambda point: point[1])  # the first best, as fairseq keeps it
        return f"{_fmt(accuracy, 1)}/{_fmt(dict(curve(log['valid1'], 'accuracy')).get(at), 1)}"
    return _fmt(best(log["valid"], "accuracy"), 1)


def paper_cell(value, digits: int) -> str:
    """A published figure as printed beside ours: "—" for none, "OOM" as is."""
    if value is None:
        return "—"
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def paper_note(table_key: str, attention: str, what: str) -> str:
    """Which row of a paper table (``paper_results.TABLES[table_key]``) the paper column of ``attention`` comes from."""
    table = paper_results.TABLES[table_key]
    row = table.ours.get(attention)
    if row is None:
        return f"paper: {table.source} has no row for {attention} (—)."
    return f"paper: {table.source}, row \"{row}\" ({what}); — : no published figure. Settings: docs/recipes.md §3."


GLUE_NOTE = "GLUE dev accuracy, RoBERTa-base pretrained on WikiText-103; MNLI a single figure"
PG19_NOTE = "token-level perplexity of a 12-layer GPT-2 trained at 8192 tokens, at 1x, 1.5x, 2x that context"


def glue_summary(attention: str, run_dirs: List[Path]) -> str:
    """A markdown row per attention like LLN Table 1: best validation accuracy per task (run dir = .../TASK/ATTN),
    each followed by the paper's figure; then a line naming the paper's row."""
    cells = {}
    for run in run_dirs:
        task = Path(run).parent.name
        log_file = Path(run) / "train.log"
        cells[task] = (glue_accuracy(task, read_log(log_file, with_earlier_runs=True)) if log_file.is_file()
                       else "—")
    names = [GLUE_COLUMNS.get(t, t) for t in cells]
    header = "| attention | " + " | ".join(f"{name} | {name} paper" for name in names) + " |"
    rule = "|---|" + "---|---|" * len(cells)
    row = " | ".join(f"{ours} | {paper_cell(paper_results.glue(task, attention), 1)}" for task, ours in cells.items())
    return "\n".join([header, rule, f"| {attention} | {row} |", "", paper_note("lln_table1", attention, GLUE_NOTE)])


def pg19_summary(rows: List[dict], attention: str) -> str:
    """eval_pg19.sh's table as markdown, with LAVO Table 2's perplexity at the same context ratio."""
    lines = ["| context | ratio | loss (bits) | ppl | word ppl | paper ppl |", "|---|---|---|---|---|---|"]
    for r in rows:
        paper = paper_cell(paper_results.pg19_ppl(attention, r["ratio"]), 2)
        lines.append(f"| {int(r['context'])} | {r['ratio']:g} | {_fmt(r['loss_bits'], 3)} | {_fmt(r['ppl'], 2)} "
                     f"| {_fmt(r.get('word_ppl'), 2)} | {paper} |")
    return "\n".join(lines + ["", paper_note("lavo_table2_ppl", attention, PG19_NOTE)])


def checkpoint_attention(path: Path) -> Optional[str]:
    """The decoder attention a fairseq checkpoint was trained with (one name; None for a per-layer mix)."""
    import torch

    state = torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)
    model = (state.get("cfg") or {}).get("model") or state.get("args")
    value = model.get("decoder_attention_type") if isinstance(model, dict) else \
        getattr(model, "decoder_attention_type", None)
    names = {t.strip() for t in str(value).split(",")} if value else set()
    return names.pop() if len(names) == 1 else None


def moving_average(values: List[float], window: int) -> List[float]:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot_curves(ax, runs: Dict[str, Dict[str, List[dict]]], tag: str, key: str, title: str) -> None:
    for name, log in runs.items():
        points = curve(log[tag], key)
        if points:
            window = max(1, len(points) // 25)
            ax.plot([u for u, _ in points], moving_average([v for _, v in points], window), label=name,
                    marker="." if len(points) < 30 else None)
    ax.set_title(title + (" (moving average)" if any(len(curve(log[tag], key)) >= 50 for log in runs.values()) else ""))
    ax.set_xlabel("updates")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()


def plot_losses(pretrain, finetune, lm, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _plot_curves(axes[0], pretrain, "train_inner", "loss", "masked-LM pretraining: train loss (bits)")
    _plot_curves(axes[1], finetune, "train_inner", "loss", "fine-tuning: train loss (bits)")
    _plot_curves(axes[2], lm, "train_inner", "loss", "causal LM: train loss (bits)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_extrapolation(tables: Dict[str, List[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, rows in tables.items():
        ax.plot([r["context"] for r in rows], [r["ppl"] for r in rows], marker="o", label=name)
    if tables:
        first = next(iter(tables.values()))
        ax.axvline(first[0]["context"], color="gray", linestyle=":", label="training context")
        ax.set_xticks([r["context"] for r in first])
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("test perplexity (per token)")
    ax.set_title("causal LM: perplexity vs context length")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _logs(root: Path) -> Dict[str, Dict[str, List[dict]]]:
    """{attention: log} for root/<attention>/train.log, in the order the runs were made."""
    runs = sorted((p for p in root.glob("*/train.log")), key=lambda p: p.stat().st_mtime)
    return {p.parent.name: read_log(p) for p in runs}


def finetune_task(log_file: Path) -> Optional[str]:
    """The task a fine-tuning run read (``.../TASK-bin`` in the config fairseq-train logs first), or None."""
    if not Path(log_file).is_file():
        return None
    found = re.search(r"'data': '[^']*?([A-Za-z0-9_]+)-bin/?'", Path(log_file).read_text(errors="replace"))
    return found.group(1) if found else None


def quickstart_report(run: Path, meta: dict) -> Path:
    """REPORT.md (tables), loss_curves.png, ppl_vs_context.png in ``run``; returns the report's path."""
    pretrain, finetune, lm = _logs(run / "pretrain"), _logs(run / "finetune"), _logs(run / "lm")
    tables = {name: read_extrapolation(run / "lm" / name / "extrapolation.tsv") for name in lm
              if (run / "lm" / name / "extrapolation.tsv").is_file()}
    plot_losses(pretrain, finetune, lm, run / "loss_curves.png")
    plot_extrapolation(tables, run / "ppl_vs_context.png")

    lines = ["# Quick-start report", "",
             f"Tiny models on the CPU, trained on the KJV samples in `data/` (seed {meta.get('seed', 1)}, "
             f"the same updates for every attention). Losses are fairseq's, in bits per token; "
             f"accuracy in %.", ""]
    if meta:
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in meta.items()] + [""]
    tasks = {finetune_task(run / "finetune" / name / "train.log") for name in finetune} - {None}
    task = tasks.pop() if len(tasks) == 1 else None
    lines += ["## Bidirectional encoder: masked-LM pretraining, then fine-tuning", "",
              "| attention | MLM train loss (last) | MLM valid loss | fine-tune valid loss | "
              "fine-tune valid accuracy (best) | paper accuracy |", "|---|---|---|---|---|---|"]
    for name, log in pretrain.items():
        ft = finetune.get(name, {tag: [] for tag in TAGS})
        paper = paper_cell(paper_results.glue(task, name), 1) if task else "—"
        lines.append(f"| {name} | {_fmt(last(log['train_inner'], 'loss'), 3)} | {_fmt(last(log['valid'], 'loss'), 3)} "
                     f"| {_fmt(last(ft['valid'], 'loss'), 3)} | {_fmt(best(ft['valid'], 'accuracy'), 1)} | {paper} |")
    lines += ["", f"Paper accuracy: {paper_results.TABLES['lln_table1'].source} (RoBERTa-base pretrained on "
                  f"WikiText-103, GLUE dev accuracy) for the fine-tuning task {task or '?'}; it covers MNLI, QNLI, "
                  f"QQP and SST-2 only, so a sample task shows — (the published figures: docs/recipes.md §3)."]
    first = next(iter(tables.values()), [])
    contexts = [int(r["context"]) for r in first]
    factors = [r["ratio"] for r in first]
    header = (["attention", "LM train loss (last)", "LM valid loss"] + [f"test ppl @{c}" for c in contexts]
              + [f"paper ppl @{f:g}x" for f in factors])
    lines += ["", "## Causal LM: training, then perplexity at 1x, 1.5x, 2x the training context", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, log in lm.items():
        ppl = [_fmt(r["ppl"], 1) for r in tables.get(name, [])] or ["—"] * len(contexts)
        paper = [paper_cell(paper_results.pg19_ppl(name, f), 2) for f in factors]
        cells = [name, _fmt(last(log["train_inner"], "loss"), 3), _fmt(last(log["valid"], "loss"), 3), *ppl, *paper]
        lines.append("| " + " | ".join(cells) + " |")
    ours = paper_results.TABLES["lavo_table2_ppl"].ours
    lines += ["", f"Paper ppl: {paper_results.TABLES['lavo_table2_ppl'].source}, at the same multiple of the "
                  f"training context (a 12-layer GPT-2 trained 125K steps at 8192 tokens on PG-19, against this "
                  f"tiny model at {contexts[0] if contexts else '?'} tokens: compare how perplexity moves with "
                  f"context, not its level); rows: " + ", ".join(f"{k} = {v}" for k, v in ours.items())
              + "; the others have no row (—)."]
    lines += ["", "## Plots and logs", "", "![loss curves](loss_curves.png)", "",
              "![perplexity against context length](ppl_vs_context.png)", "",
              f"TensorBoard: `tensorboard --logdir {run}` (every run's `tb/`); fairseq logs: `*/*/train.log`.", ""]
    report = run / "REPORT.md"
    report.write_text("\n".join(lines))
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    glue = sub.add_parser("glue", help="best validation accuracy per task, a markdown table row")
    glue.add_argument("--attention", required=True)
    glue.add_argument("runs", nargs="+", type=Path, help="fine-tuning output directories .../TASK/ATTN")
    pg19 = sub.add_parser("pg19", help="eval_pg19.sh's extrapolation.tsv as markdown, with the paper's perplexity")
    pg19.add_argument("table", type=Path, help="extrapolation.tsv")
    pg19.add_argument("--attention", default="", help="the LM's attention [read from --checkpoint]")
    pg19.add_argument("--checkpoint", type=Path, help="the evaluated checkpoint (its decoder attention type)")
    quick = sub.add_parser("quickstart", help="REPORT.md and plots of a quick-start run directory")
    quick.add_argument("run", type=Path)
    quick.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="a row of the settings table")
    args = parser.parse_args(argv)
    if args.command == "glue":
        print(glue_summary(args.attention, args.runs))
    elif args.command == "pg19":
        attention = args.attention or (checkpoint_attention(args.checkpoint) if args.checkpoint else None)
        print(pg19_summary(read_extrapolation(args.table), attention or "?"))
    else:
        meta = dict(item.split("=", 1) for item in args.meta)
        report = quickstart_report(args.run, meta)
        print(f"[quickstart] report: {report}")
        print(f"[quickstart] plots:  {args.run / 'loss_curves.png'}  {args.run / 'ppl_vs_context.png'}")
        print(f"[quickstart] TensorBoard: tensorboard --logdir {args.run}")


if __name__ == "__main__":
    main()

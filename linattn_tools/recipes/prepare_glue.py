"""GLUE for RoBERTa fine-tuning: hub rows -> input0/input1/label text -> BPE -> fairseq data-bin.

Source: ``nyu-mll/glue`` (configs mnli, qnli, qqp, sst2) or a local directory in the hub's layout
(``<task>/<split>-*.parquet`` or ``<task>/<split>.jsonl``), e.g. the shipped ``data/glue_sample``
(tasks kjv_testament, kjv_next_verse). Writes what fairseq's ``preprocess_GLUE_tasks.sh`` writes:
``<out>/<task>-bin/input0``, ``input1`` (pair tasks) and ``label``, with splits ``train``, ``valid``
and, for MNLI, ``valid1`` (validation_matched -> valid, validation_mismatched -> valid1). Labels are
written as their names (entailment, ...); ``fairseq-preprocess`` builds the label dictionary from
them (ordered by frequency), so a prediction ``i`` is the label
``task.label_dictionary.string([i + task.label_dictionary.nspecial])``. Test splits (labels -1) are
not written.

    python -m linattn_tools.recipes.prepare_glue --out data-bin/glue --tasks mnli,qnli,qqp,sst2
"""
import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

from tqdm import tqdm

from . import bpe
from .binarize import binarize
from .sources import SourceError, fingerprint, load_splits, run_cli
from .steps import run_step, write_lines


@dataclass(frozen=True)
class Task:
    columns: Tuple[str, ...]  # text columns -> input0, input1
    labels: Tuple[str, ...]  # label names by integer label
    valid: Tuple[str, ...] = ("validation",)  # hub splits -> valid, valid1, ...


TASKS = {
    "mnli": Task(("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 ("validation_matched", "validation_mismatched")),
    "qnli": Task(("question", "sentence"), ("entailment", "not_entailment")),
    "qqp": Task(("question1", "question2"), ("not_duplicate", "duplicate")),
    "sst2": Task(("sentence",), ("negative", "positive")),
    # the shipped samples (data/glue_sample, made by make_samples.py)
    "kjv_testament": Task(("sentence",), ("old", "new")),
    "kjv_next_verse": Task(("sentence1", "sentence2"), ("next", "not_next")),
}
GLUE_TASKS = ("mnli", "qnli", "qqp", "sst2")


def fairseq_splits(task: Task) -> dict:
    """{fairseq split: hub split}: train, valid, valid1, ..."""
    valid = {("valid" if i == 0 else f"valid{i}"): name for i, name in enumerate(task.valid)}
    return {"train": "train", **valid}


def label_names(dataset, task: Task) -> Tuple[str, ...]:
    """The dataset's ClassLabel names when it has them (hub parquet), else the task's."""
    feature = dataset.features["label"]
    return tuple(getattr(feature, "names", None) or task.labels)


def write_raw(name: str, task: Task, rows_by_split: dict, out: Path) -> None:
    """<split>.input0, <split>.input1, <split>.label; one example per line, rows with label -1 dropped."""
    for split, rows in rows_by_split.items():
        names = label_names(rows, task)
        labelled = rows.filter(lambda label: label >= 0, input_columns="label")
        for i, column in enumerate(task.columns):
            texts = tqdm(labelled[column], desc=f"{name} {split}.input{i}", unit=" rows", mininterval=2)
            write_lines(out / f"{split}.input{i}", (" ".join(text.split()) for text in texts))
        write_lines(out / f"{split}.label", (names[label] for label in labelled["label"]))


def prepare_task(name: str, args, out: Path) -> Path:
    task = TASKS[name]
    splits = fairseq_splits(task)
    raw_params = {"source": fingerprint(args.source), "task": name}

    def load_and_write(tmp: Path) -> None:
        hub = load_splits(args.source, name, list(splits.values()), args.cache_dir)
        write_raw(name, task, {split: hub[hub_split] for split, hub_split in splits.items()}, tmp)

    raw = run_step(f"{name} raw text", out / name / "raw", raw_params, load_and_write)
    assets = bpe.prepare_tokenizer(args, None, out, raw_params)
    spec = bpe.tokenizer_spec(args.bpe, assets)
    bpe_params = {"tokenizer": bpe.describe(assets), "input": raw_params}
    inputs = [f"input{i}" for i in range(len(task.columns))]

    def encode(tmp: Path) -> None:
        for split in splits:
            for column in inputs:
                bpe.encode_file(spec, raw / f"{split}.{column}", tmp / f"{split}.{column}", args.workers)

    encoded = run_step(f"{name} bpe", out / name / "bpe", bpe_params, encode)
    valid = [s for s in splits if s != "train"]

    def binarize_all(tmp: Path) -> None:
        for column in inputs:
            binarize(tmp / column, encoded / f"train.{column}", [encoded / f"{s}.{column}" for s in valid],
                     srcdict=assets["dict"], workers=args.workers)
        binarize(tmp / "label", raw / "train.label", [raw / f"{s}.label" for s in valid], workers=args.workers)

    return run_step(f"{name} binarize", out / f"{name}-bin", {"input": bpe_params}, binarize_all)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.prepare_glue", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="nyu-mll/glue", help="hub dataset name or local directory")
    parser.add_argument("--tasks", default=",".join(GLUE_TASKS),
                        help=f"comma list from {{{', '.join(TASKS)}}} (default: %(default)s)")
    parser.add_argument("--out", required=True, help="output directory (<task>-bin/ inside)")
    parser.add_argument("--cache-dir", help="HuggingFace datasets cache directory")
    bpe.add_tokenizer_args(parser, sp_vocab_size=None)
    args = parser.parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise SourceError(f"--tasks: unknown {unknown or 'empty list'}; allowed: {', '.join(TASKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"[prepare] {name} ready: {prepare_task(name, args, out)}")


if __name__ == "__main__":
    run_cli(main)

"""WikiText-103 for RoBERTa pretraining: hub rows -> wiki.{train,valid,test}.raw -> BPE -> fairseq data-bin.

Source: ``Salesforce/wikitext`` config ``wikitext-103-raw-v1`` (the S3 zip in fairseq's README is
gone), or a local directory: a snapshot of that hub repository (``<config>/<split>-*.parquet``) or
a directory holding ``wiki.{train,valid,test}.raw`` themselves. Each hub row is one line of the
original file: non-empty rows keep their trailing newline, and the blank lines (a single space in
the files) are empty rows; ``raw_lines`` undoes exactly that.

Output (``--out``): ``raw/``, ``spm/`` or ``gpt2_bpe/``, ``bpe/``, ``bin/`` (the data directory for
``fairseq-train --task masked_lm``). Each step is skipped when its completion marker says it is done.

    python -m linattn_tools.recipes.prepare_wikitext103 --out data-bin/wikitext-103 --workers 16
"""
import argparse
from pathlib import Path
from typing import Iterable, Iterator

from tqdm import tqdm

from . import bpe
from .binarize import tokenize_and_binarize
from .sources import fingerprint, load_splits, run_cli
from .steps import run_step, write_lines

HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # fairseq name -> hub split


def raw_lines(rows: Iterable[str]) -> Iterator[str]:
    """Hub rows -> the lines of wiki.*.raw (without newlines): blank rows are ' ' lines."""
    for row in rows:
        line = row[:-1] if row.endswith("\n") else row
        yield line if line.strip() else " "


def load_rows(source: str, config: str, cache_dir=None) -> dict:
    """{fairseq split: datasets.Dataset with a 'text' column}."""
    path = Path(source)
    if path.is_dir() and all((path / f"wiki.{s}.raw").is_file() for s in HUB_SPLITS):
        import datasets  # the unzipped wikitext-103-raw-v1 files: one row per line, newline kept

        return {s: datasets.load_dataset("text", data_files={s: str(path / f"wiki.{s}.raw")}, split=s,
                                         keep_linebreaks=True, cache_dir=cache_dir) for s in HUB_SPLITS}
    hub = load_splits(source, config, list(HUB_SPLITS.values()), cache_dir)
    return {s: hub[h] for s, h in HUB_SPLITS.items()}


def write_raw(rows_by_split: dict, out: Path) -> None:
    for split, rows in rows_by_split.items():
        lines = raw_lines(tqdm(rows["text"], desc=f"wiki.{split}.raw", unit=" rows", mininterval=2))
        write_lines(out / f"wiki.{split}.raw", lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.prepare_wikitext103",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="Salesforce/wikitext", help="hub dataset name or local directory")
    parser.add_argument("--config", default="wikitext-103-raw-v1", help="hub config (default: %(default)s)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--cache-dir", help="HuggingFace datasets cache directory")
    bpe.add_tokenizer_args(parser, sp_vocab_size=32000)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    raw_params = {"source": fingerprint(args.source), "config": args.config}
    run_step("raw text", out / "raw", raw_params,
             lambda tmp: write_raw(load_rows(args.source, args.config, args.cache_dir), tmp))
    tokenize_and_binarize(args, out, raw_params, "wiki.{split}.raw", "WikiText-103")


if __name__ == "__main__":
    run_cli(main)

"""PG-19 for the long-context LM: books -> one document per book -> BPE -> fairseq data-bin.

``deepmind/pg19`` on the hub is a loading-script dataset that current ``datasets`` refuses, so
``--source`` is either a parquet mirror on the hub (any dataset with a ``text`` column and splits
train, validation, test) or a local directory: a snapshot of such a mirror (``data/<split>-*.parquet``)
or a directory of books, ``<split>/*.txt`` for split in train, validation, test (one book per file,
e.g. the shipped ``data/pg19_sample``). ``--max-books N`` keeps the first N books of each split.

Each book becomes one document: its non-empty lines, then a blank line (fairseq's document break).
Output (``--out``): ``raw/pg19.{train,valid,test}.txt``, the tokeniser, ``bpe/``, ``bin/`` (the data
directory for ``fairseq-train --task language_modeling``).

    python -m linattn_tools.recipes.prepare_pg19 --source DIR --out data-bin/pg19 --workers 16
"""
import argparse
from pathlib import Path
from typing import Iterable, List, Optional

from tqdm import tqdm

from . import bpe
from .binarize import tokenize_and_binarize
from .sources import SourceError, fingerprint, load_splits, run_cli
from .steps import run_step

HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # fairseq name -> source split


def document_lines(book: str) -> List[str]:
    """A book's non-empty lines, stripped (blank lines would split it into several documents)."""
    return [line.strip() for line in book.splitlines() if line.strip()]


def book_files(directory: Path, split: str) -> Optional[List[Path]]:
    """``directory/split/*.txt`` sorted by name, or None when that folder does not exist."""
    folder = directory / split
    return sorted(folder.glob("*.txt")) if folder.is_dir() else None


def load_books(source: str, split: str, max_books: Optional[int], cache_dir=None) -> Iterable[str]:
    """The texts of one split's books (at most ``max_books``)."""
    path = Path(source)
    if path.is_dir() and book_files(path, split) is not None:
        files = book_files(path, split)[:max_books]
        if not files:
            raise SourceError(f"--source {source}: no *.txt books in {path / split}")
        return (f.read_text(encoding="utf-8", errors="replace") for f in files)
    if path.is_dir() or max_books is None:
        rows = load_splits(source, None, [split], cache_dir)[split]
        rows = rows.select(range(min(max_books, len(rows)))) if max_books is not None else rows
        return rows["text"]
    import datasets  # a hub mirror, partial: stream the first books instead of downloading every shard

    try:
        return (row["text"] for row in datasets.load_dataset(source, split=split, streaming=True).take(max_books))
    except Exception as err:
        raise SourceError(f"could not stream '{source}' from the HuggingFace hub ({type(err).__name__}: {err}). "
                          f"Without network access, pass a local directory: --source DIR") from err


def write_documents(books: Iterable[str], path: Path, desc: str) -> int:
    """One document per book, each followed by a blank line; returns the number of books."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for book in tqdm(books, desc=desc, unit=" books"):
            f.writelines(line + "\n" for line in document_lines(book))
            f.write("\n")
            n += 1
    if n == 0:
        raise SourceError(f"{desc}: no books")
    return n


def write_raw(args, out: Path) -> None:
    for split, source_split in HUB_SPLITS.items():
        books = load_books(args.source, source_split, args.max_books, args.cache_dir)
        write_documents(books, out / f"pg19.{split}.txt", f"pg19.{split}.txt")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.prepare_pg19", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="parquet mirror on the hub, or a local directory")
    parser.add_argument("--max-books", type=int, help="keep the first N books of each split (partial runs)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--cache-dir", help="HuggingFace datasets cache directory")
    bpe.add_tokenizer_args(parser, sp_vocab_size=32000)
    args = parser.parse_args(argv)
    if args.max_books is not None and args.max_books < 1:
        raise SourceError(f"--max-books must be >= 1, got {args.max_books}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    raw_params = {"source": fingerprint(args.source), "max_books": args.max_books}
    run_step("raw text", out / "raw", raw_params, lambda tmp: write_raw(args, tmp))
    tokenize_and_binarize(args, out, raw_params, "pg19.{split}.txt", "PG-19")


if __name__ == "__main__":
    run_cli(main)

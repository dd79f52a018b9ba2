"""Prepare the shipped samples in ``data/`` for the CPU runs (quick-start, ``SAMPLE=1`` scripts).

Runs the three real recipes on them with SentencePiece (no network): WikiText-format KJV ->
``<out>/wikitext/bin`` (masked LM), the GLUE-shaped sets -> ``<out>/glue/<task>-bin`` (with the
pretraining SentencePiece model and dictionary), the sample books -> ``<out>/pg19/bin`` (LM).
Finished steps are skipped, so a second run takes a few seconds.

    python -m linattn_tools.recipes.prepare_samples --out data-bin/samples
"""
import argparse
from pathlib import Path

from . import prepare_glue, prepare_pg19, prepare_wikitext103
from .sources import run_cli

DATA = Path(__file__).resolve().parents[2] / "data"
SAMPLE_TASKS = ("kjv_testament", "kjv_next_verse")
SP_VOCAB = 2000


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.prepare_samples", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--data", default=str(DATA), help="the samples directory (default: the repository's data/)")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    out, data, workers = Path(args.out), Path(args.data), str(args.workers)
    common = ["--bpe", "sentencepiece", "--workers", workers]
    prepare_wikitext103.main(["--source", str(data / "wikitext_kjv"), "--out", str(out / "wikitext"),
                              "--sp-vocab-size", str(SP_VOCAB), *common])
    spm = out / "wikitext" / "spm"
    prepare_glue.main(["--source", str(data / "glue_sample"), "--tasks", ",".join(SAMPLE_TASKS),
                       "--out", str(out / "glue"), "--sp-model", str(spm / "spm.model"),
                       "--sp-dict", str(spm / "dict.txt"), *common])
    prepare_pg19.main(["--source", str(data / "pg19_sample"), "--out", str(out / "pg19"),
                       "--sp-vocab-size", str(SP_VOCAB), *common])


if __name__ == "__main__":
    run_cli(main)

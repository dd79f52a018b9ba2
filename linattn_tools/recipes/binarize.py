"""Binarise tokenised text with ``fairseq-preprocess --only-source`` (fairseq's indexed datasets),
and the tokenize-then-binarise tail shared by the WikiText-103 and PG-19 recipes."""
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from . import bpe
from .steps import run_step


def preprocess_command() -> List[str]:
    """``fairseq-preprocess`` of this interpreter's environment (its module if the script is absent)."""
    script = Path(sys.executable).parent / "fairseq-preprocess"
    if script.is_file():
        return [str(script)]
    found = shutil.which("fairseq-preprocess")
    return [found] if found else [sys.executable, "-m", "fairseq_cli.preprocess"]


def binarize(destdir: Path, trainpref: Path, validpref: Optional[List[Path]] = None, testpref: Optional[Path] = None,
             srcdict: Optional[Path] = None, workers: int = 1) -> None:
    """fairseq-preprocess into ``destdir``: train, valid (valid1, ... for several), test; dict from train
    unless ``srcdict`` is given. Raises RuntimeError with fairseq's output on failure."""
    cmd = [*preprocess_command(), "--only-source", "--trainpref", str(trainpref), "--destdir", str(destdir),
           "--workers", str(workers)]
    if validpref:
        cmd += ["--validpref", ",".join(str(p) for p in validpref)]
    if testpref:
        cmd += ["--testpref", str(testpref)]
    if srcdict:
        cmd += ["--srcdict", str(srcdict)]
    print("[prepare] " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


def tokenize_and_binarize(args, out: Path, raw_params: dict, raw_file: str, label: str) -> None:
    """The common tail of the LM-style recipes: tokenizer -> bpe/ -> bin/ under ``out``.

    ``raw_file`` names ``out/raw/<raw_file with {split}>`` for the train, valid and test splits (e.g.
    ``wiki.{split}.raw``); each step is skipped when its completion marker says it is done.
    """
    splits = ("train", "valid", "test")
    raw = {split: out / "raw" / raw_file.format(split=split) for split in splits}
    stem = {split: Path(raw_file.format(split=split)).stem for split in splits}
    assets = bpe.prepare_tokenizer(args, raw["train"], out, raw_params)
    spec = bpe.tokenizer_spec(args.bpe, assets)
    bpe_params = {"tokenizer": bpe.describe(assets), "input": raw_params}

    def encode(tmp: Path) -> None:
        for split in splits:
            bpe.encode_file(spec, raw[split], tmp / f"{stem[split]}.bpe", args.workers)

    run_step("bpe", out / "bpe", bpe_params, encode)
    bpe_file = {split: out / "bpe" / f"{stem[split]}.bpe" for split in splits}
    run_step("binarize", out / "bin", {"input": bpe_params},
             lambda tmp: binarize(tmp, bpe_file["train"], [bpe_file["valid"]], bpe_file["test"],
                                  srcdict=assets["dict"], workers=args.workers))
    print(f"[prepare] {label} ready: {out / 'bin'}")

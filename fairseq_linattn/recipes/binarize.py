"""Binarise tokenised text with ``fairseq-preprocess --only-source`` (fairseq's indexed datasets)."""
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional


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

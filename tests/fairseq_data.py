"""Tiny generated corpora binarised with fairseq-preprocess, for end-to-end tests of the plugin."""
import os
import random
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
USER_DIR = str(ROOT / "fairseq_linattn")


def write_corpus(path: Path, lines: int, seed: int) -> None:
    """Zipf-distributed words over a 300-word vocabulary, with some repeated phrases to learn."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(300)]
    weights = [1 / (i + 1) for i in range(300)]
    with open(path, "w") as f:
        for _ in range(lines):
            n = rng.randint(4, 30)
            words = rng.choices(vocab, weights, k=n)
            if rng.random() < 0.5:
                words[:3] = ["the", "quick", "fox"]
            f.write(" ".join(words) + "\n")


def run(cmd, timeout=600, **kw):
    """Run a fairseq console script from the venv; raise with its output on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def make_lm_data(root: Path) -> Path:
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_corpus(raw / "train.txt", 1500, 0)
    write_corpus(raw / "valid.txt", 100, 1)
    out = root / "bin"
    run(["fairseq-preprocess", "--only-source", "--trainpref", raw / "train.txt", "--validpref",
         raw / "valid.txt", "--destdir", out, "--workers", "1"])
    return out


def make_classification_data(root: Path, lm_bin: Path) -> Path:
    """A sentence_prediction set: label 1 when the line starts with 'the quick fox' (fairseq's GLUE layout)."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, lines, seed in (("train", 400, 2), ("valid", 60, 3)):
        write_corpus(raw / f"{split}.txt", lines, seed)
        text = (raw / f"{split}.txt").read_text().splitlines()
        (raw / f"{split}.label").write_text("".join(f"{int(t.startswith('the quick fox'))}\n" for t in text))
    out = root / "bin"
    run(["fairseq-preprocess", "--only-source", "--trainpref", raw / "train.txt", "--validpref", raw / "valid.txt",
         "--destdir", out / "input0", "--srcdict", lm_bin / "dict.txt", "--workers", "1"])
    run(["fairseq-preprocess", "--only-source", "--trainpref", raw / "train.label", "--validpref",
         raw / "valid.label", "--destdir", out / "label", "--workers", "1"])
    return out


def make_translation_data(root: Path) -> Path:
    """src -> tgt where the target is the source reversed, with a joined dictionary."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, lines, seed in (("train", 800, 4), ("valid", 50, 5)):
        write_corpus(raw / f"{split}.src", lines, seed)
        src = (raw / f"{split}.src").read_text().splitlines()
        (raw / f"{split}.tgt").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in src))
    out = root / "bin"
    run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", raw / "train",
         "--validpref", raw / "valid", "--testpref", raw / "valid", "--destdir", out, "--joined-dictionary",
         "--workers", "1"])
    return out

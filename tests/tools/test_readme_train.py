"""The README's "Train your own model" CPU command, as pasted: from the repository root, then from another directory
(the data path given as a path, ``--user-dir`` from ``python -m fairseq_linattn --user-dir``). Slow tier: it prepares
the samples (~1 min) and trains twice (~20 s each)."""
import os
import re
import subprocess

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def readme_block(heading: str) -> str:
    """The first ```bash block after ``heading`` in the README."""
    section = (ROOT / "README.md").read_text().split(f"\n{heading}\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def run(script: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1200)


@pytest.fixture(scope="module")
def block():
    text = readme_block("## Train your own model")
    assert text.startswith("source .venv/bin/activate") and "fairseq-train data-bin/samples/wikitext/bin" in text
    return text


@pytest.fixture(scope="module")
def from_root(block, tmp_path_factory):
    """The block run as pasted in a stand-in for the repository root (the clone's .venv linked in, so that the
    relative paths it writes, data-bin/, checkpoints/ and runs/, stay out of the clone)."""
    root = tmp_path_factory.mktemp("root")
    (root / ".venv").symlink_to(ROOT / ".venv")
    return root, run(block, root)


def test_the_readme_command_trains_from_the_repository_root(from_root):
    root, proc = from_root
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done training" in proc.stderr + proc.stdout
    assert (root / "checkpoints" / "roberta_lln_tiny" / "checkpoint_last.pt").is_file()
    assert any((root / "runs" / "tb").rglob("events.out.tfevents.*"))


def test_the_readme_command_trains_from_another_directory(block, from_root, tmp_path):
    root, _ = from_root
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    train = block[block.index("\nfairseq-train ") + 1:]  # the samples prepared above, given by their path
    train = train.replace("fairseq-train data-bin/", f"fairseq-train {root}/data-bin/")
    assert "prepare_samples" not in train
    proc = run(f"source {ROOT}/.venv/bin/activate\n{train}", elsewhere)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (elsewhere / "checkpoints" / "roberta_lln_tiny" / "checkpoint_last.pt").is_file()
    assert not (elsewhere / "fairseq_linattn").exists()  # the plugin came from its printed path

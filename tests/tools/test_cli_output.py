"""What our commands print: progress lines and real warnings, no library DEBUG lines, no tensorboardX notice."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT

DEBUG_LINE = re.compile(r"^DEBUG:|\| DEBUG \|", re.MULTILINE)  # logging's default format and fairseq's


def python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)


def test_importing_the_plugin_keeps_warnings_and_drops_debug_lines_and_the_tensorboardx_notice(tmp_path):
    code = textwrap.dedent("""
        import logging, warnings
        import fairseq_linattn
        logging.getLogger("datasets").debug("a library's debug line")
        logging.getLogger("fairseq.tasks.text_to_speech").warning("a real warning")
        warnings.warn("a python warning")
        print("[prepare] progress")
    """)
    proc = python(["-c", code], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[prepare] progress" in out and "a real warning" in out and "a python warning" in out
    assert "a library's debug line" not in out and not DEBUG_LINE.search(out), out
    assert "tensorboardX" not in out, out


@pytest.mark.extended  # ~11 s: fairseq-train's import; the plugin's import without the notice is checked above
def test_fairseq_commands_print_no_tensorboardx_notice(tmp_path):
    """fairseq-train (and every fairseq command) sets INFO logging and imports its tasks before it loads the plugin;
    its text_to_speech task then said "Please install tensorboardX" whenever tensorboardX was missing, although
    --tensorboard-logdir writes through torch.utils.tensorboard. tensorboardX is a dependency (setup.py)."""
    proc = python(["-c", "import fairseq_cli.train"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "tensorboardX" not in out, out


def test_a_logging_set_up_made_before_the_import_is_kept(tmp_path):
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
        import fairseq_linattn
        logging.getLogger("x").info("an info line")
        logging.getLogger("x").debug("a debug line")
    """)
    proc = python(["-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "INFO an info line" in proc.stdout and "a debug line" not in proc.stdout


@pytest.mark.extended  # ~20 s: SentencePiece training and fairseq-preprocess
def test_prepare_command_prints_its_progress_and_no_debug_lines_or_tensorboardx_notice(tmp_path):
    proc = python(["-m", "linattn_tools.recipes.prepare_pg19", "--source", str(ROOT / "data" / "pg19_sample"),
                   "--out", str(tmp_path / "pg19"), "--bpe", "sentencepiece", "--sp-vocab-size", "500",
                   "--cache-dir", str(tmp_path / "cache")], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for line in ("[prepare] raw text ->", "[prepare] sentencepiece ->", "[prepare] binarize ->",
                 "[prepare] PG-19 ready:"):
        assert line in proc.stdout, out[-4000:]
    assert not DEBUG_LINE.search(out), DEBUG_LINE.findall(out)[:5]
    assert "tensorboardX" not in out

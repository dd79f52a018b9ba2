"""The CPU quick-start (FAST=1) end to end: every recipe script on the shipped samples, then the report (slow tier)."""
import math
import os
import re
import subprocess

import pytest
from helpers import ROOT

ENCODERS = ("softmax", "lln", "lln_diag")
DECODERS = ("softmax", "lln", "lavo")
pytestmark = pytest.mark.slow  # runs the shell recipes and fairseq-train (minutes)


def run(cmd, env, timeout=900):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "FAST": "1", "RUN": str(root / "run"), "SAMPLE_DATA": str(root / "data"),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = run(["bash", "scripts/quickstart.sh"], env)
    return root, env, proc


def table_rows(report: str, heading: str, paper: bool = False):
    """{first cell: other cells} of the markdown table after ``heading``: our columns, or (paper=True)
    {first cell: {header: cell}} of the paper columns."""
    section = report.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    header = rows[0]
    ours = [i for i, h in enumerate(header) if i and not h.startswith("paper")]
    if paper:
        return {cells[0]: {h: c for h, c in zip(header, cells) if h.startswith("paper")} for cells in rows[1:]}
    return {cells[0]: [cells[i] for i in ours] for cells in rows[1:]}


def test_fast_quickstart_reports_losses_accuracies_and_perplexities_per_attention(quickstart):
    root, _, proc = quickstart
    run_dir = root / "run"
    report = (run_dir / "REPORT.md").read_text()
    assert f"report: {run_dir / 'REPORT.md'}" in proc.stdout  # it says where the report is
    encoder = table_rows(report, "## Bidirectional encoder")
    decoder = table_rows(report, "## Causal LM")
    assert set(encoder) == set(ENCODERS) and set(decoder) == set(DECODERS)
    for cells in [*encoder.values(), *decoder.values()]:
        values = [float(c) for c in cells]
        assert all(math.isfinite(v) and v > 0 for v in values)
    assert all(0 <= float(cells[3]) <= 100 for cells in encoder.values())  # accuracy in %
    assert re.search(r"test ppl @128 \| test ppl @192 \| test ppl @256", report)
    # beside ours, the paper's figure where it has one (LAVO Table 2; no GLUE figure for the sample task)
    paper_lm = table_rows(report, "## Causal LM", paper=True)
    assert paper_lm["lavo"] == {"paper ppl @1x": "19.43", "paper ppl @1.5x": "19.41", "paper ppl @2x": "19.40"}
    assert list(paper_lm["softmax"].values()) == ["16.02", "40.33", "94.34"]
    assert list(paper_lm["lln"].values()) == ["—", "—", "—"]
    rows = table_rows(report, "## Bidirectional", paper=True)
    assert all(cells == {"paper accuracy": "—"} for cells in rows.values())
    assert "fine-tuning task kjv_testament" in report
    for png in ("loss_curves.png", "ppl_vs_context.png"):
        data = (run_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_every_quickstart_run_leaves_checkpoints_and_tensorboard_logs(quickstart):
    root, _, _ = quickstart
    runs = [root / "run" / stage / name for stage, names in
            (("pretrain", ENCODERS), ("finetune", ENCODERS), ("lm", DECODERS)) for name in names]
    for run_dir in runs:
        assert (run_dir / "checkpoint_last.pt").is_file()
        assert list((run_dir / "tb" / "train_inner").glob("events.out.tfevents.*")), run_dir
    for name in DECODERS:
        rows = [row.split("\t") for row in (root / "run" / "lm" / name / "extrapolation.tsv").read_text().splitlines()]
        assert [row[0] for row in rows] == ["context", "128", "192", "256"]
        assert rows[0] == ["context", "ratio", "loss_bits", "ppl", "word_ppl"]
        for row in rows[1:]:  # SentencePiece cuts a word into more than one token: a word costs more
            assert math.isfinite(float(row[4])) and float(row[4]) > float(row[3]) > 1


def test_eval_pg19_prints_the_paper_perplexity_of_the_checkpoints_attention(quickstart):
    root, _, _ = quickstart
    paper = {"softmax": ["16.02", "40.33", "94.34"], "lln": ["—", "—", "—"], "lavo": ["19.43", "19.41", "19.40"]}
    for name in DECODERS:  # the attention is read from the checkpoint
        log = (root / "run" / "logs" / f"lm_{name}_eval.log").read_text()
        rows = [line for line in log.splitlines() if re.match(r"\| (128|192|256) \|", line)]
        assert [row.strip("|").split("|")[-1].strip() for row in rows] == paper[name], log
        assert [row.split("|")[2].strip() for row in rows] == ["1", "1.5", "2"]


def test_prepared_samples_are_not_prepared_twice(quickstart):
    root, env, _ = quickstart
    marker = root / "data" / "pg19" / "bin" / ".done"
    before = marker.stat().st_mtime_ns
    proc = run([str(ROOT / ".venv" / "bin" / "python"), "-m",
                "linattn_tools.recipes.prepare_samples", "--out", str(root / "data")], env)
    assert proc.stdout.count("done already") == 14 and marker.stat().st_mtime_ns == before


def test_glue_all_fine_tunes_every_sample_task_and_summarises_them(quickstart):
    root, env, _ = quickstart
    env = {**env, "DEVICE": "cpu", "SAMPLE": "1", "OUT_ROOT": str(root / "glue")}
    checkpoint = root / "run" / "pretrain" / "lln_diag" / "checkpoint_last.pt"
    proc = run(["bash", "scripts/glue_all.sh", "lln_diag", str(checkpoint)], env)
    header, _, row, _, note = proc.stdout.strip().splitlines()[-5:]
    assert header == "| attention | KJV testament | KJV testament paper | KJV next verse | KJV next verse paper |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "lln_diag" and all(0 <= float(c) <= 100 for c in cells[1::2])
    assert cells[2::2] == ["—", "—"]  # LLN Table 1 has no figure for the sample tasks
    assert note.startswith("paper: LLN") and 'row "LLN+Diag Attention"' in note
    assert (root / "glue" / "summary_lln_diag.md").read_text().strip().splitlines()[-3] == row
    again = run(["bash", "scripts/glue_all.sh", "lln_diag", str(checkpoint)], env)
    assert again.stdout.count("finished already") == 2 and again.stdout.strip().splitlines()[-3] == row

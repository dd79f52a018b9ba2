"""Recipe reports: fairseq logs read into the quick-start report, GLUE and PG-19 summaries beside the papers."""
import json
from pathlib import Path

from linattn_tools.recipes import report


def fake_log(path: Path, losses, valid, extra_valid=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{'_name': None, 'common': {}}", "begin training"]
    lines += [json.dumps({"epoch": 1, "loss": str(v), "num_updates": str(i + 1), "train_wall": "0"})
              for i, v in enumerate(losses)]
    lines += [json.dumps({"epoch": 1, "valid_loss": str(v), "valid_accuracy": str(a), "valid_num_updates": str(u)})
              for u, v, a in valid]
    lines += [json.dumps(r) for r in (extra_valid or [])]
    lines.append(json.dumps({"epoch": 1, "train_loss": "1.0", "train_num_updates": "3"}))
    path.write_text("\n".join(lines) + "\n")


def test_report_reads_fairseq_logs_and_writes_tables_and_plots(tmp_path):
    fake_log(tmp_path / "mnli" / "lln" / "train.log", [3, 2], [(2, 1.5, 61.0), (4, 1.2, 64.5)],
             [{"epoch": 1, "valid1_loss": "1.3", "valid1_accuracy": "63.25", "valid1_num_updates": "4"}])
    log = report.read_log(tmp_path / "mnli" / "lln" / "train.log")
    assert [len(log[t]) for t in report.TAGS] == [2, 1, 2, 1]
    assert report.glue_summary("lln", [tmp_path / "mnli" / "lln"]).splitlines()[2] == "| lln | 64.5/63.2 | 77.0 |"
    # mismatched is read at the update of the best matched accuracy (the checkpoint fairseq keeps)
    fake_log(tmp_path / "mnli" / "lln_diag" / "train.log", [3, 2], [(2, 1.5, 61.0), (4, 1.2, 64.5)],
             [{"epoch": 1, "valid1_loss": "1.4", "valid1_accuracy": "66.0", "valid1_num_updates": "2"},
              {"epoch": 1, "valid1_loss": "1.3", "valid1_accuracy": "63.0", "valid1_num_updates": "4"}])
    assert report.glue_summary("lln_diag", [tmp_path / "mnli" / "lln_diag"]).splitlines()[2] == \
        "| lln_diag | 64.5/63.0 | 80.0 |"

    run = tmp_path / "run"
    stages = (("pretrain", ["softmax", "lln"]), ("finetune", ["softmax", "lln"]), ("lm", ["softmax", "lavo"]))
    for stage, names in stages:
        for k, name in enumerate(names):
            fake_log(run / stage / name / "train.log", [9 - k, 7 - k, 6 - k], [(3, 6.5 - k, 50 + 10 * k)])
    for k, name in enumerate(["softmax", "lavo"]):
        (run / "lm" / name / "extrapolation.tsv").write_text(
            "context\tratio\tloss_bits\tppl\n" + "".join(f"{c}\t{c / 128:g}\t{8 + k}\t{100 * (k + 1) + c}\n"
                                                         for c in (128, 192, 256)))
    text = report.quickstart_report(run, {"seed": 1}).read_text()
    assert "| lln | 5.000 | 5.500 | 5.500 | 60.0 |" in text
    assert "| lavo | 5.000 | 5.500 | 328.0 | 392.0 | 456.0 |" in text
    # the paper columns: LAVO Table 2 at 1x, 1.5x, 2x; no GLUE figure without a known GLUE task
    assert "| paper ppl @1x | paper ppl @1.5x | paper ppl @2x |" in text
    assert "| 328.0 | 392.0 | 456.0 | 19.43 | 19.41 | 19.40 |" in text
    assert "| 228.0 | 292.0 | 356.0 | 16.02 | 40.33 | 94.34 |" in text  # softmax: FlashAttention
    assert "| lln | 5.000 | 5.500 | 5.500 | 60.0 | — |" in text
    for png in ("loss_curves.png", "ppl_vs_context.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def glue_table(text: str):
    """{header cell: row cell} of a one-row markdown table at the start of ``text``."""
    header, _, row = text.splitlines()[:3]
    return dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))


def test_glue_summary_reads_the_runs_before_a_rerun(tmp_path):
    # an interrupted fine-tuning rerun into the same OUT: its best accuracy is in the earlier run's log
    fake_log(tmp_path / "sst-2" / "lln" / "train.log.1", [3], [(2, 1.5, 81.0), (4, 1.2, 88.5)])
    fake_log(tmp_path / "sst-2" / "lln" / "train.log.2", [3], [(6, 1.1, 86.0)])
    fake_log(tmp_path / "sst-2" / "lln" / "train.log", [3], [(8, 1.0, 87.0)])
    assert [p.name for p in report.run_logs(tmp_path / "sst-2" / "lln" / "train.log")] == \
        ["train.log.1", "train.log.2", "train.log"]
    assert "| 88.5 |" in report.glue_summary("lln", [tmp_path / "sst-2" / "lln"]).splitlines()[2]


def test_glue_summary_puts_lln_table1_beside_each_task(tmp_path):
    runs = []
    for k, task in enumerate(("mnli", "qnli", "qqp", "sst2")):
        fake_log(tmp_path / task / "lln_diag" / "train.log", [3, 2], [(2, 1.5, 70.0 + k)])
        runs.append(tmp_path / task / "lln_diag")
    text = report.glue_summary("lln_diag", runs)
    cells = glue_table(text)
    assert list(cells) == ["attention", "MNLI (m/mm)", "MNLI (m/mm) paper", "QNLI", "QNLI paper", "QQP",
                           "QQP paper", "SST-2", "SST-2 paper"]
    assert cells["QNLI"] == "71.0" and cells["MNLI (m/mm)"] == "70.0/—"
    assert [cells[f"{t} paper"] for t in ("MNLI (m/mm)", "QNLI", "QQP", "SST-2")] == ["80.0", "86.5", "89.7", "91.6"]
    assert 'row "LLN+Diag Attention"' in text.splitlines()[-1]
    assert glue_table(report.glue_summary("softmax", runs))["SST-2 paper"] == "90.6"  # SA baseline
    lavo = report.glue_summary("lavo", runs)
    assert all(v == "—" for k, v in glue_table(lavo).items() if k.endswith("paper")) and "no row" in lavo
    sample = glue_table(report.glue_summary("lln", [tmp_path / "kjv_testament" / "lln"]))
    assert sample == {"attention": "lln", "KJV testament": "—", "KJV testament paper": "—"}


def test_pg19_summary_puts_lavo_table2_beside_each_context_ratio():
    rows = [{"context": c, "ratio": r, "loss_bits": 4.0, "ppl": 16.0, "word_ppl": float("nan")}
            for c, r in ((128, 1.0), (192, 1.5), (256, 2.0), (512, 4.0))]
    text = report.pg19_summary(rows, "lavo")
    assert text.splitlines()[0].endswith("| word ppl | paper ppl |")
    assert text.splitlines()[2:6] == ["| 128 | 1 | 4.000 | 16.00 | — | 19.43 |",
                                      "| 192 | 1.5 | 4.000 | 16.00 | — | 19.41 |",
                                      "| 256 | 2 | 4.000 | 16.00 | — | 19.40 |", "| 512 | 4 | 4.000 | 16.00 | — | — |"]
    assert [line.split("|")[-2].strip() for line in report.pg19_summary(rows, "softmax").splitlines()[2:6]] == \
        ["16.02", "40.33", "94.34", "—"]
    assert all(line.endswith("| — |") for line in report.pg19_summary(rows, "lln").splitlines()[2:6])


def test_quickstart_paper_accuracy_follows_the_fine_tuning_task_in_the_log(tmp_path):
    run = tmp_path / "run"
    for stage in ("pretrain", "finetune"):
        fake_log(run / stage / "lln" / "train.log", [3, 2], [(2, 1.5, 60.0)])
    log = run / "finetune" / "lln" / "train.log"
    assert report.finetune_task(log) is None
    log.write_text("{'task': {'_name': 'sentence_prediction', 'data': '/x/glue/sst2-bin'}}\n" + log.read_text())
    assert report.finetune_task(log) == "sst2"
    assert "| lln | 2.000 | 1.500 | 1.500 | 60.0 | 90.6 |" in report.quickstart_report(run, {}).read_text()

"""Recipes: data preparation through `datasets` on local hub-shaped files, configs, scripts, reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the HuggingFace hub
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
from helpers import ROOT

from linattn_tools.recipes import config, make_samples, prepare_glue, prepare_pg19, prepare_wikitext103, steps  # noqa: E402
from linattn_tools.recipes.bpe import gpt2_files, train_sentencepiece  # noqa: E402
from linattn_tools.recipes.sources import SourceError, run_cli  # noqa: E402

DATA = ROOT / "data"
SCRIPTS = ["pretrain_wikitext103.sh", "finetune_glue.sh", "train_pg19.sh", "eval_pg19.sh", "glue_all.sh",
           "quickstart.sh"]


def hub_rows(raw_text: str):
    """Rows as the hub's WikiText parquet has them: each line with its newline; blank lines empty."""
    return [line if line.strip() else "" for line in raw_text.splitlines(keepends=True)]


def write_parquet(path: Path, columns: dict, features=None) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(path))


def load_fairseq(prefix: Path, dict_path: Path):
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(str(dict_path))
    return dictionary, data_utils.load_indexed_dataset(str(prefix), dictionary)


# --- WikiText-103 -------------------------------------------------------------------------------

def test_wikitext_raw_files_are_rebuilt_byte_for_byte_from_hub_shaped_parquet(tmp_path, capsys):
    train = (DATA / "wikitext_kjv" / "wiki.valid.raw").read_text()
    example = (DATA / "wikitext_example.raw").read_text()
    src = tmp_path / "Salesforce_wikitext" / "wikitext-103-raw-v1"
    for split, text in (("train", train), ("validation", example), ("test", example)):
        write_parquet(src / f"{split}-00000-of-00001.parquet", {"text": hub_rows(text)})
    out = tmp_path / "out"
    argv = ["--source", str(src.parent), "--out", str(out), "--bpe", "sentencepiece", "--sp-vocab-size", "300",
            "--cache-dir", str(tmp_path / "cache")]
    prepare_wikitext103.main(argv)

    assert (out / "raw" / "wiki.train.raw").read_text() == train
    assert (out / "raw" / "wiki.valid.raw").read_bytes() == (DATA / "wikitext_example.raw").read_bytes()
    dictionary, valid = load_fairseq(out / "bin" / "valid", out / "bin" / "dict.txt")
    assert len(valid) == len(example.splitlines())  # one fairseq item per line, blank lines included
    heading = dictionary.string(valid[1][:-1])  # ' = Bible Retrieval System = ' as SentencePiece pieces
    assert heading.replace(" ", "").replace("\u2581", " ").strip() == "= Bible Retrieval System ="

    capsys.readouterr()
    prepare_wikitext103.main(argv)  # everything is done: nothing runs again
    assert capsys.readouterr().out.count("done already") == 4


def test_wikitext_rows_keep_their_newline_and_blank_rows_become_space_lines():
    rows = ["", " = A = \n", "", " text @-@ here . \n", " last"]
    assert list(prepare_wikitext103.raw_lines(rows)) == [" ", " = A = ", " ", " text @-@ here . ", " last"]


# --- completion markers -------------------------------------------------------------------------

def test_an_interrupted_step_is_redone_and_a_finished_one_skipped(tmp_path):
    out = tmp_path / "step"
    calls = []

    def crash(tmp):
        (tmp / "half.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        steps.run_step("s", out, {"v": 1}, crash)
    assert not out.exists() and not steps.is_done(out, {"v": 1})  # half-written output is not taken as done

    def build(tmp):
        calls.append(1)
        (tmp / "full.txt").write_text("full")

    steps.run_step("s", out, {"v": 1}, build)
    steps.run_step("s", out, {"v": 1}, build)
    assert len(calls) == 1 and (out / "full.txt").read_text() == "full" and not (out / "half.txt").exists()
    steps.run_step("s", out, {"v": 2}, build)  # other parameters: built again
    assert len(calls) == 2


# --- GLUE ---------------------------------------------------------------------------------------

def tiny_gpt2_files(directory: Path) -> Path:
    """A byte-level GPT-2 BPE in fairseq's file format: 256 byte tokens and two merges."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merges = [("t", "h"), ("th", "e")]
    encoder = {token: i for i, token in enumerate(byte_tokens + ["".join(m) for m in merges])}
    directory.mkdir(parents=True)
    (directory / "encoder.json").write_text(json.dumps(encoder))
    (directory / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (directory / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(len(encoder))))
    return directory


@pytest.mark.extended
def test_glue_mnli_from_hub_shaped_parquet_gives_fairseq_layout_with_gpt2_bpe(tmp_path):
    import datasets
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    names = ["entailment", "neutral", "contradiction"]
    features = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=names), "idx": datasets.Value("int32")})
    premises = [f"the cat sat on mat {i}" for i in range(12)]
    splits = {"train": [0, 1, 2, 0, 0, 1, 2, 2, 2, 0, 1, 2], "validation_matched": [2, 1, 0, 0],
              "validation_mismatched": [1, 1, 2, 0], "test_matched": [-1, -1, -1, -1]}
    for split, labels in splits.items():
        n = len(labels)
        write_parquet(tmp_path / "glue" / "mnli" / f"{split}-00000-of-00001.parquet",
                      {"premise": premises[:n], "hypothesis": [f"a\tcat\n{i}" for i in range(n)],
                       "label": labels, "idx": list(range(n))}, features)
    gpt2 = tiny_gpt2_files(tmp_path / "gpt2")
    out = tmp_path / "out"
    prepare_glue.main(["--source", str(tmp_path / "glue"), "--tasks", "mnli", "--out", str(out), "--gpt2-dir",
                       str(gpt2), "--cache-dir", str(tmp_path / "cache")])

    bin_dir = out / "mnli-bin"
    for column in ("input0", "input1", "label"):
        assert {p.name for p in (bin_dir / column).glob("*.bin")} == {"train.bin", "valid.bin", "valid1.bin"}
    raw = out / "mnli" / "raw"
    assert (raw / "valid1.label").read_text().split() == [names[i] for i in splits["validation_mismatched"]]
    assert (raw / "train.input1").read_text().splitlines()[3] == "a cat 3"  # tabs, newlines flattened
    label_dict, labels = load_fairseq(bin_dir / "label" / "train", bin_dir / "label" / "dict.txt")
    decoded = [label_dict[int(item[0])] for item in labels]
    assert decoded == [names[i] for i in splits["train"]]  # labels go through the label dictionary
    assert label_dict.index("contradiction") == label_dict.nspecial  # the most frequent label comes first
    token_dict, inputs = load_fairseq(bin_dir / "input0" / "valid", bin_dir / "input0" / "dict.txt")
    bpe = get_encoder(str(gpt2 / "encoder.json"), str(gpt2 / "vocab.bpe"))
    ids = [int(token_dict[int(t)]) for t in inputs[2][:-1]]
    assert bpe.decode(ids) == premises[2] and bpe.encoder["the"] in ids


def test_glue_tasks_read_their_columns_and_label_names(tmp_path):
    import datasets

    rows = datasets.Dataset.from_dict({"question1": ["q one?", "q two?", "q three"], "question2": ["a", "b", "c"],
                                       "label": [1, 0, -1], "idx": [0, 1, 2]})
    prepare_glue.write_raw("qqp", prepare_glue.TASKS["qqp"], {"train": rows}, tmp_path)
    assert (tmp_path / "train.input0").read_text() == "q one?\nq two?\n"
    assert (tmp_path / "train.label").read_text() == "duplicate\nnot_duplicate\n"  # label -1 (test) dropped
    assert prepare_glue.fairseq_splits(prepare_glue.TASKS["mnli"]) == {
        "train": "train", "valid": "validation_matched", "valid1": "validation_mismatched"}
    assert prepare_glue.TASKS["qnli"].columns == ("question", "sentence")
    assert prepare_glue.TASKS["sst2"].columns == ("sentence",)


def test_glue_with_sentencepiece_needs_the_pretraining_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        run_cli(prepare_glue.main, ["--source", str(DATA / "glue_sample"), "--tasks", "kjv_testament",
                                    "--out", str(tmp_path), "--bpe", "sentencepiece"])
    assert stop.value.code == 2 and "--sp-model" in capsys.readouterr().err


# --- PG-19 --------------------------------------------------------------------------------------

def test_pg19_parquet_mirror_gives_one_document_per_book_and_max_books(tmp_path):
    books = sorted((DATA / "pg19_sample" / "train").glob("*.txt"))
    texts = [p.read_text() for p in books]
    for split, chosen in (("train", texts[:3]), ("validation", texts[3:4]), ("test", texts[4:5])):
        write_parquet(tmp_path / "pg19" / "data" / f"{split}-00000-of-00001.parquet",
                      {"short_book_title": [t.splitlines()[0] for t in chosen],
                       "publication_date": [1611] * len(chosen), "url": ["u"] * len(chosen), "text": chosen})
    out = tmp_path / "out"
    prepare_pg19.main(["--source", str(tmp_path / "pg19"), "--max-books", "2", "--out", str(out), "--bpe",
                       "sentencepiece", "--sp-vocab-size", "500", "--cache-dir", str(tmp_path / "cache")])

    documents = (out / "raw" / "pg19.train.txt").read_text().split("\n\n")
    assert len(documents) == 3 and documents[2] == ""  # two books, each closed by a blank line
    assert documents[0].splitlines() == prepare_pg19.document_lines(texts[0])
    assert "" not in documents[0].splitlines()  # a book's own blank lines do not split it
    _, test = load_fairseq(out / "bin" / "test", out / "bin" / "dict.txt")
    assert len(test) == len(prepare_pg19.document_lines(texts[4])) + 1


def test_missing_dataset_or_network_fails_saying_how_to_pass_a_local_path(tmp_path, capsys):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "linattn_tools.recipes.prepare_glue", "--tasks", "sst2",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "nyu-mll/glue" in proc.stderr and "--source DIR" in proc.stderr
    with pytest.raises(SystemExit) as stop:
        run_cli(prepare_pg19.main, ["--source", str(tmp_path), "--out", str(tmp_path / "o"), "--bpe", "sentencepiece"])
    assert stop.value.code == 2 and "no files for splits" in capsys.readouterr().err
    with pytest.raises(SourceError, match="--gpt2-dir"):
        gpt2_files(tmp_path / "nothing", download=False)


# --- shipped samples ----------------------------------------------------------------------------

def test_wikitext_tokens_follow_wikitext_conventions():
    assert make_samples.wikitext_tokens("The king's well-beloved son, 1,000.5 men; (all) went.") == \
        "The king 's well @-@ beloved son , 1 @,@ 000 @.@ 5 men ; ( all ) went ."


def test_bible_text_is_parsed_into_books_chapters_and_wrapped_verses():
    text = ("\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  2 And the earth was\n"
            "without form.\n\n1 Samuel 2\n\n  1 And Hannah prayed.\n")
    assert make_samples.parse_bible(text) == {
        "Genesis": [["In the beginning God created the heaven and the earth.", "And the earth was without form."]],
        "1 Samuel": [["And Hannah prayed."]]}


def test_shipped_samples_are_small_balanced_and_split_without_overlap():
    size = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert size < 4_000_000
    for task, labels in (("kjv_testament", 2), ("kjv_next_verse", 2)):
        rows = {s: [json.loads(line) for line in open(DATA / "glue_sample" / task / f"{s}.jsonl")]
                for s in ("train", "validation")}
        for split_rows in rows.values():
            counts = [sum(r["label"] == c for r in split_rows) for c in range(labels)]
            assert min(counts) == max(counts)
        text = "sentence" if task == "kjv_testament" else "sentence1"
        assert not {r[text] for r in rows["train"]} & {r[text] for r in rows["validation"]}
    for path in [*(DATA / "wikitext_kjv").glob("*.raw"), DATA / "wikitext_example.raw"]:
        lines = path.read_text().splitlines()
        assert all(line.startswith(" ") for line in lines) and lines[1].startswith(" = ")


# --- configs ------------------------------------------------------------------------------------

def test_update_freq_keeps_the_papers_batch():
    roberta = config.load(ROOT / "configs" / "pretrain_wikitext103.yaml")["batch"]
    assert config.batch_split(roberta, 8) == {"per_device": 16, "update_freq": 16, "effective": 2048}
    assert config.batch_split(roberta, 1)["update_freq"] == 128
    assert config.batch_split(roberta, 3)["effective"] >= 2048
    pg19 = config.load(ROOT / "configs" / "pg19_lm.yaml")["batch"]
    assert config.batch_split(pg19, 8) == {"per_device": 8192, "update_freq": 2, "effective": 2 ** 17}
    glue = config.load(ROOT / "configs" / "glue.yaml")["batch"]
    assert config.batch_split(glue, 8) == {"per_device": 4, "update_freq": 1, "effective": 32}
    assert config.batch_split(glue, 1, update_freq=4)["effective"] == 128


def test_batch_split_keeps_the_total_whole_samples_and_says_when_it_cannot(capsys):
    roberta = config.load(ROOT / "configs" / "pretrain_wikitext103.yaml")
    pg19 = config.load(ROOT / "configs" / "pg19_lm.yaml")
    glue = config.load(ROOT / "configs" / "glue.yaml")
    for devices in range(1, 33):
        split = config.batch_split(roberta["batch"], devices)
        assert split["per_device"] <= 16 and abs(split["effective"] / 2048 - 1) <= 0.01, devices
        if 2048 % devices == 0:
            assert split["effective"] == 2048, devices
        split = config.batch_split(pg19["batch"], devices, granule=config.granule(pg19))
        assert split["per_device"] == 8192, devices  # one whole 8192-token sample: never fewer tokens
        if 16 % devices == 0:
            assert split["effective"] == 2 ** 17, devices
        # the closest whole-sample batch: no other update-freq comes nearer to 2^17
        assert all(abs(devices * f - 16) >= abs(split["effective"] // 8192 - 16) for f in range(1, 40))
    assert config.batch_split(glue["batch"], 3)["effective"] == 33  # 3 x 11 (3 x 10 = 30 is further)
    assert config.batch_split(glue["batch"], 5)["effective"] == 30
    config.main(["args", str(ROOT / "configs" / "glue.yaml"), "--task", "mnli", "--devices", "3"])
    out, err = capsys.readouterr()
    assert "--batch-size\n11\n--update-freq\n1" in out
    assert "33 sequences per update, not the paper's 32" in err
    config.main(["args", str(ROOT / "configs" / "glue.yaml"), "--task", "mnli", "--devices", "8"])
    assert "not the paper's" not in capsys.readouterr().err


def test_args_on_the_cpu_give_cpu_and_no_fp16_whatever_says_the_device(monkeypatch, capsys):
    """The sample sections are CPU runs: ``args --sample`` on a CPU (``--device cpu``, ``DEVICE=cpu``, or no GPU that
    torch sees) gives ``--cpu`` and none of the fp16 options, which fairseq cannot run on a CPU; a GPU keeps them."""
    import torch

    glue = ["args", str(ROOT / "configs" / "glue.yaml"), "--task", "kjv_testament", "--sample"]

    def argv(*extra, device_env=None, cuda=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        if device_env is None:
            monkeypatch.delenv("DEVICE", raising=False)
        else:
            monkeypatch.setenv("DEVICE", device_env)
        config.main([*glue, *extra])
        return capsys.readouterr().out.split()

    fp16 = {"--fp16", "--fp16-init-scale", "--fp16-scale-window", "--threshold-loss-scale"}
    for cpu in ({}, {"device_env": "cpu", "cuda": True}, {"extra": ("--device", "cpu"), "cuda": True}):
        case = argv(*cpu.pop("extra", ()), **cpu)
        assert "--cpu" in case and not fp16 & set(case), case
        assert case[-2:] == ["--update-freq", "1"]
    for gpu in ({"extra": ("--device", "gpu")}, {"device_env": "gpu"}, {"cuda": True}):
        case = argv(*gpu.pop("extra", ()), **gpu)
        assert fp16 <= set(case) and "--cpu" not in case, case
    assert "--fp16" not in argv("--device", "gpu", "--no-fp16")


def test_configs_hold_the_papers_hyper_parameters():
    pre = config.train_options(config.load(ROOT / "configs" / "pretrain_wikitext103.yaml"))
    assert (pre["tokens-per-sample"], pre["lr"], pre["warmup-updates"], pre["max-update"]) == (512, 5e-4, 10000, 125000)
    glue = config.load(ROOT / "configs" / "glue.yaml")
    assert glue["batch"]["total"] == 32 and glue["train"]["lr"] == 1e-5 and glue["train"]["max-epoch"] == 10
    warmup = {t: o["warmup-updates"] / o["total-num-update"] for t, o in glue["tasks"].items()}
    assert warmup.pop("qqp") == pytest.approx(0.25, abs=0.01)  # QQP's official warmup
    assert all(w == pytest.approx(0.06, abs=0.001) for w in warmup.values())
    lm = config.load(ROOT / "configs" / "pg19_lm.yaml")
    opts = config.train_options(lm)
    assert (opts["tokens-per-sample"], lm["batch"]["total"], opts["lr"], opts["adam-betas"], opts["weight-decay"],
            opts["warmup-updates"], opts["max-update"], opts["dropout"]) == \
        (8192, 2 ** 17, 5e-4, "(0.9,0.999)", 0.01, 10000, 125000, 0.1)
    assert lm["eval"]["contexts"] == [8192, 12288, 16384]


def test_every_config_gives_options_fairseq_train_accepts(tmp_path):
    from fairseq import options

    cases = [("pretrain_wikitext103.yaml", None, ["--encoder-attention-type", "lln_diag"]),
             ("pg19_lm.yaml", None, ["--decoder-attention-type", "lavo"])]
    cases += [("glue.yaml", task, ["--encoder-attention-type", "lln"]) for task in ("mnli", "qnli", "qqp", "sst2")]
    for name, task, extra in cases:
        for sample in (False, True):
            cfg = config.load(ROOT / "configs" / name, sample)
            sample_task = config.task_names(cfg)[0] if sample and task else None
            argv = config.fairseq_args(cfg, devices=8, task=sample_task or task, device="cpu" if sample else "gpu")
            parser = options.get_training_parser()
            args = options.parse_args_and_arch(parser, [str(tmp_path), "--user-dir", str(ROOT / "fairseq_linattn"),
                                                        *argv, *extra])
            assert args.arch == cfg["train"]["arch"] and args.update_freq == [int(argv[-1])]


# --- scripts ------------------------------------------------------------------------------------

# the positional arguments each script's usage names, and the attention role it checks
def test_sentencepiece_dictionary_lists_pieces_in_id_order(tmp_path):
    assets = train_sentencepiece(DATA / "wikitext_kjv" / "wiki.valid.raw", tmp_path, vocab_size=300)
    import sentencepiece as spm

    model = spm.SentencePieceProcessor(model_file=assets["model"])
    pieces = [line.split()[0] for line in open(assets["dict"], encoding="utf-8")]
    assert pieces == [model.id_to_piece(i) for i in range(3, model.get_piece_size())]


def test_encoding_with_several_workers_gives_the_same_lines(tmp_path):
    from linattn_tools.recipes import bpe

    assets = train_sentencepiece(DATA / "wikitext_kjv" / "wiki.valid.raw", tmp_path / "spm", vocab_size=300)
    spec = bpe.tokenizer_spec("sentencepiece", assets)
    src = DATA / "wikitext_kjv" / "wiki.valid.raw"
    bpe.encode_file(spec, src, tmp_path / "one.txt", workers=1)
    bpe.encode_file(spec, src, tmp_path / "two.txt", workers=2)
    one = (tmp_path / "one.txt").read_text().splitlines()
    assert (tmp_path / "two.txt").read_text().splitlines() == one
    assert len(one) == len(src.read_text().splitlines()) and one[0] == "" and one[1].startswith("\u2581=")


@pytest.mark.parametrize("missing", ["datasets", "sentencepiece"])
def test_a_missing_package_stops_a_prepare_command_in_one_line_before_any_work(monkeypatch, capsys, tmp_path, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ImportError
    calls = []
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda argv: calls.append(argv), ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not calls
    assert err.count("\n") == 1 and f"needs the Python package '{missing}'" in err and f"pip install {missing}" in err

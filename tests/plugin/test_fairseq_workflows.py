"""fairseq workflows beyond plain training: fine-tuning, linearization, decoding, DDP, precision."""
import json
import os
import subprocess
import sys

import pytest
import torch
from fairseq_data import USER_DIR, make_classification_data, make_lm_data, make_translation_data, run, write_corpus
from test_fairseq_cli import TRAIN_COMMON, train_lm

# end to end: fairseq's command lines on generated data; CI runs them through the quick-start, the README's
# train command and the GPU self-test on the CPU (tests/tools)
pytestmark = pytest.mark.extended

TINY_ROBERTA = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
                "--encoder-attention-heads", "2"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_data(tmp_path_factory.mktemp("lmdata"))


def load_model_state(path):
    return torch.load(path, weights_only=False)["model"]


def test_softmax_roberta_checkpoint_linearizes_and_fine_tunes_on_sentence_prediction(lm_data, tmp_path):
    """Stock roberta (softmax) -> linattn_roberta with LLN+Diag (learnable mix) via --finetune-from-model."""
    run(["fairseq-train", lm_data, "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "roberta_base",
         *TINY_ROBERTA, "--tokens-per-sample", "64", "--batch-size", "8", "--save-dir", tmp_path / "stock",
         *TRAIN_COMMON])
    cls_data = make_classification_data(tmp_path / "cls", lm_data)
    run(["fairseq-train", cls_data, "--task", "sentence_prediction", "--criterion", "sentence_prediction",
         "--num-classes", "2", "--arch", "linattn_roberta_tiny", "--encoder-attention-type", "lln_diag",
         "--lln-diag-mix", "learnable_scale", "--lln-diag-block-size", "16", "--max-positions", "64",
         "--init-token", "0", "--separator-token", "2", "--batch-size", "8", "--save-dir", tmp_path / "lin",
         "--finetune-from-model", tmp_path / "stock" / "checkpoint_last.pt", "--best-checkpoint-metric",
         "accuracy", "--maximize-best-checkpoint-metric", *TRAIN_COMMON, "--max-update", "4", "--lr", "1e-9"])
    stock = load_model_state(tmp_path / "stock" / "checkpoint_last.pt")
    lin = load_model_state(tmp_path / "lin" / "checkpoint_last.pt")
    key = "encoder.sentence_encoder.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(lin[key], stock[key], atol=1e-5, rtol=0)  # lr 1e-9: the swap kept the weights
    assert "encoder.sentence_encoder.layers.1.self_attn.mix_p" in lin  # the new part started fresh
    assert "classification_heads.sentence_classification_head.dense.weight" in lin
    code = f"""
import fairseq_linattn, torch
from fairseq.models.roberta import RobertaModel
m = RobertaModel.from_pretrained({str(tmp_path / 'lin')!r}, checkpoint_file='checkpoint_last.pt',
                                 data_name_or_path={str(cls_data)!r}, user_dir={USER_DIR!r}, bpe=None).eval()
logp = m.predict('sentence_classification_head', torch.tensor([[0, 5, 6, 7, 2]]))
assert logp.shape == (1, 2) and torch.allclose(logp.exp().sum(), torch.tensor(1.0))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_softmax_lm_checkpoint_linearizes_into_lavo_and_lln(lm_data, tmp_path):
    train_lm(lm_data, tmp_path / "stock", "softmax")
    proc = train_lm(lm_data, tmp_path / "lin", "lavo,lln", "--finetune-from-model",
                    tmp_path / "stock" / "checkpoint_last.pt", "--lavo-token-positions")
    assert "starting it from its initial value" in proc.stdout + proc.stderr
    lin = load_model_state(tmp_path / "lin" / "checkpoint_last.pt")
    assert "decoder.layers.0.self_attn.bases" in lin and "decoder.layers.1.self_attn.matcher.ema_var_q" in lin


def test_lm_beam_search_and_sampling_through_fairseq_generators(lm_data, tmp_path):
    train_lm(lm_data, tmp_path, "lln,lavo")
    code = f"""
import fairseq_linattn, torch
from fairseq.models.transformer_lm import TransformerLanguageModel
lm = TransformerLanguageModel.from_pretrained({str(tmp_path)!r}, 'checkpoint_last.pt', {str(lm_data)!r},
                                              user_dir={USER_DIR!r})
lm.eval()
tokens = lm.task.source_dictionary.encode_line('the quick fox', add_if_not_exist=False)[:-1].long()
hyps = lm.generate([tokens], beam=4, max_len_b=12, nbest=4)[0]
assert len(hyps) == 4 and all(torch.isfinite(h['score']) for h in hyps)
print('beams', [lm.task.source_dictionary.string(h['tokens']) for h in hyps])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    proc = run(["fairseq-interactive", lm_data, "--task", "language_modeling",
                "--path", tmp_path / "checkpoint_last.pt",
                "--user-dir", USER_DIR, "--cpu", "--sampling", "--beam", "1", "--sampling-topk", "10",
                "--max-len-b", "10", "--seed", "3"], input="the quick fox\nw1 w2\n")
    hyps = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 2
    run(["fairseq-validate", lm_data, "--task", "language_modeling", "--path", tmp_path / "checkpoint_last.pt",
         "--user-dir", USER_DIR, "--cpu", "--max-tokens", "2048", "--tokens-per-sample", "64"])


def test_translation_with_lavo_cross_attention_trains_and_generates(tmp_path):
    data = make_translation_data(tmp_path / "mt")
    run(["fairseq-train", data, "--task", "translation", "--arch", "linattn_transformer_tiny",
         "--encoder-attention-type", "lln", "--decoder-attention-type", "lavo", "--cross-attention-type", "lavo",
         "--lavo-window", "8", "--criterion", "label_smoothed_cross_entropy", "--max-tokens", "1024",
         "--save-dir", tmp_path / "ckpt", *TRAIN_COMMON])
    proc = run(["fairseq-generate", data, "--path", tmp_path / "ckpt" / "checkpoint_last.pt", "--user-dir", USER_DIR,
                "--cpu", "--beam", "4", "--max-tokens", "1024", "--gen-subset", "valid", "--max-len-b", "20"])
    hyps = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    translated = int((proc.stdout + proc.stderr).split("Translated ")[1].split()[0])
    assert len(hyps) == translated >= 45  # every valid sentence the length filter kept got a hypothesis


@pytest.mark.parametrize("extra", [["--checkpoint-activations"], ["--bf16"]])
def test_lm_trains_with_activation_checkpointing_and_bf16(lm_data, tmp_path, extra):
    proc = train_lm(lm_data, tmp_path, "lln,lln_diag", *extra)
    log = proc.stdout + proc.stderr
    assert "num_updates 6" in log.replace("num_updates=6", "num_updates 6").replace('"num_updates": "6"',
                                                                                   "num_updates 6")
    state = load_model_state(tmp_path / "checkpoint_last.pt")
    assert all(torch.isfinite(t.float()).all() for t in state.values())


def test_cpu_ddp_two_ranks_equal_one_process_on_the_same_global_batch(lm_data, tmp_path):
    # fixed alpha/beta: batch statistics (and EMA folds) are per micro-batch, so they differ legitimately
    # between 2 ranks x 1 micro-batch and 1 process x 2 micro-batches
    args = [str(lm_data), "--task", "language_modeling", "--arch", "linattn_lm_tiny", "--decoder-attention-type",
            "lln,lavo", "--lln-alpha", "2", "--lln-beta", "2", "--lavo-window", "8", "--tokens-per-sample", "32",
            "--batch-size", "4", "--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--max-update", "4",
            "--dropout", "0", "--no-epoch-checkpoints", "--num-workers", "0", "--seed", "1", "--no-progress-bar"]
    two = subprocess.run([sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--", *args,
                          "--save-dir", str(tmp_path / "two")], capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-4000:]
    assert "distributed init (rank 1)" in two.stderr + two.stdout or "world_size: 2" in two.stderr
    run(["fairseq-train", *args, "--cpu", "--save-dir", tmp_path / "one", "--update-freq", "2"])
    a = load_model_state(tmp_path / "two" / "checkpoint_last.pt")
    b = load_model_state(tmp_path / "one" / "checkpoint_last.pt")
    assert a.keys() == b.keys()
    for key in a:
        if ".matcher.ema_var_" in key:  # statistics folded per micro-batch (1 per rank vs 2 per update)
            continue
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)
    # resuming: rank 0 loads checkpoint_last.pt and fairseq broadcasts it as a pickle to rank 1
    more = [*args, "--save-dir", str(tmp_path / "two")]
    more[more.index("--max-update") + 1] = "6"
    resumed = subprocess.run([sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--", *more],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "@ 4 updates" in resumed.stderr + resumed.stdout  # "Loaded checkpoint ... (epoch 1 @ 4 updates)"
    assert load_model_state(tmp_path / "two" / "checkpoint_last.pt").keys() == a.keys()


# fairseq-train that also writes, per rank, the alpha and beta of every training forward's moment matching
RECORDING_TRAIN = """
import json, os, sys
from fairseq_cli.train import cli_main  # first, as under fairseq-train: its logging set-up
import torch.distributed as dist
from fairseq_linattn.modules.moment_matcher import MomentMatcher
from linattn_tools.ddp_rank import run

match = MomentMatcher._match

def recording_match(self, var, like):
    result = match(self, var, like)
    if self.training:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(os.environ["LINATTN_RECORD_DIR"], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps([self.last_alpha.tolist(), self.last_beta.tolist()]) + "\\n")
    return result

MomentMatcher._match = recording_match
sys.exit(run(cli_main))
"""


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def ddp_and_one_process(tmp_path, lines, *extra):
    """masked_lm with --lln-stats ema: 2 gloo ranks x batches of 4 and 1 process x batches of 8 on ``lines``
    generated sequences; returns per-rank (alpha, beta) records, train_inner logs and final model states."""
    raw = tmp_path / "raw"
    raw.mkdir()
    write_corpus(raw / "train.txt", lines, 11)
    write_corpus(raw / "valid.txt", 8, 12)
    data = tmp_path / "bin"
    run(["fairseq-preprocess", "--only-source", "--trainpref", raw / "train.txt", "--validpref", raw / "valid.txt",
         "--destdir", data, "--workers", "1"])
    script = tmp_path / "recording_train.py"
    script.write_text(RECORDING_TRAIN)
    # one sequence per sample, batches as asked (fairseq's default multiple of 8 drops samples from batches of 4)
    args = [str(data), "--task", "masked_lm", "--criterion", "masked_lm", "--arch", "linattn_roberta_tiny",
            "--encoder-attention-type", "lln,lln_diag", "--lln-stats", "ema", "--lln-diag-block-size", "8",
            "--sample-break-mode", "eos", "--tokens-per-sample", "64", "--required-batch-size-multiple", "1",
            "--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--max-update", "4", "--dropout", "0",
            "--attention-dropout", "0", "--no-epoch-checkpoints", "--num-workers", "0", "--seed", "1",
            "--no-progress-bar", "--log-format", "json", "--log-interval", "1", "--disable-validation", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = {"two": [sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--train-command",
                    f"{sys.executable} {script}", "--", *args, "--batch-size", "4"],
            "one": [sys.executable, str(script), *args, "--cpu", "--batch-size", "8"]}
    records, logs, states = {}, {}, {}
    for name, cmd in runs.items():
        (tmp_path / f"rec_{name}").mkdir()
        proc = subprocess.run([*cmd, "--save-dir", str(tmp_path / name)], capture_output=True, text=True,
                              timeout=600, env={**env, "LINATTN_RECORD_DIR": str(tmp_path / f"rec_{name}")})
        assert proc.returncode == 0, proc.stderr[-4000:]
        records[name] = [read_records(path) for path in sorted((tmp_path / f"rec_{name}").glob("rank*.jsonl"))]
        logs[name] = [json.loads(line.split("|")[-1]) for line in (proc.stdout + proc.stderr).splitlines()
                      if "| train_inner |" in line]
        states[name] = load_model_state(tmp_path / name / "checkpoint_last.pt")
    return records, logs, states


def check_ddp_equals_one_process(records, logs, states):
    (rank0, rank1), (single,) = records["two"], records["one"]
    assert len(rank0) == len(rank1) == len(single) == 4 * 2  # 4 updates x 2 LLN layers
    assert rank0 == rank1  # statistics folded from one all-reduce per update: the same on both ranks
    for (a2, b2), (a1, b1) in zip(rank0, single):
        assert a2 == pytest.approx(a1, rel=1e-6) and b2 == pytest.approx(b1, rel=1e-6)
    # the statistics changed with every update and layer (the first update's two layers both read the initial 1)
    assert len({a for (a,), _ in single}) == len(single) - 1
    assert len(logs["two"]) == len(logs["one"]) == 4
    for a, b in zip(logs["two"], logs["one"]):
        assert a["bsz"] == b["bsz"]  # the same global batch
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), abs=2e-3)  # logged with 3 decimals
    a, b = states["two"], states["one"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)


def test_cpu_ddp_statistics_fold_like_one_process_on_the_global_batch(tmp_path):
    """--lln-stats ema under 2 gloo ranks x 4 sequences: each update folds the statistics of all 8 (one
    all-reduce), so alpha, beta, losses and parameters equal a 1-process run with batches of 8. (``batch``
    statistics are each rank's own in the forward, as batch normalisation's: tests/plugin/test_moment_sync.py.)"""
    # 4 updates of 8 sequences, one epoch; grouped shuffling hands the 2 ranks of an update the two halves
    # of the 1-process batch
    records, logs, states = ddp_and_one_process(tmp_path, 32, "--grouped-shuffling")
    assert all(log["bsz"] == "8" for log in logs["two"])
    check_ddp_equals_one_process(records, logs, states)


def test_cpu_ddp_statistics_leave_out_a_ranks_dummy_batch(tmp_path):
    """A rank without data runs fairseq's dummy batch (a copy of a real one, ignore_grad=True): metrics_hook
    runs it inside statistics_left_out(), so it adds nothing to the update's all-reduced statistics."""
    # 28 sequences in 7 batches of 4, unshuffled (--curriculum 1): the 4th update gives rank 0 the last
    # 4 sequences and rank 1 nothing, so rank 1 runs fairseq's dummy batch; 1 process: 8, 8, 8 and 4
    records, logs, states = ddp_and_one_process(tmp_path, 28, "--curriculum", "1")
    assert [log["bsz"] for log in logs["one"]] == ["8", "8", "8", "4"]
    check_ddp_equals_one_process(records, logs, states)


GRAPHED_TRAIN = """
import sys
from dev.perf import graph_standin
from fairseq_linattn import options
from fairseq_linattn.modules import cuda_graph
cuda_graph.capture = graph_standin.capture  # the CPU stand-in for CUDA's capture
options.check_cuda_graph = lambda args, config: None  # which refuses the option on the CPU
from fairseq_cli.train import cli_main
sys.argv = ["fairseq-train", *sys.argv[1:]]
cli_main()
"""


def test_lm_trains_through_fairseqs_trainer_with_captured_steps_as_eagerly(lm_data, tmp_path):
    """--attention-cuda-graph with the capture's CPU stand-in, through fairseq's trainer (model.train() each update,
    two batches an update, the moment matcher's deferred folds, validation in eval): the checkpoint's parameters
    and moment statistics are the eager run's."""
    from helpers import ROOT

    states = {}
    for name, extra in (("eager", []), ("graphed", ["--attention-cuda-graph"])):
        args = [str(lm_data), "--task", "language_modeling", "--arch", "linattn_lm_tiny", "--decoder-attention-type",
                "lln", "--tokens-per-sample", "32", "--batch-size", "4", "--dropout", "0", "--update-freq", "2",
                "--save-dir", str(tmp_path / name), *map(str, TRAIN_COMMON), "--max-update", "4",
                "--lln-chunk-size", "8", *extra]
        proc = subprocess.run([sys.executable, "-c", GRAPHED_TRAIN, *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        states[name] = load_model_state(tmp_path / name / "checkpoint_last.pt")
    assert states["graphed"].keys() == states["eager"].keys()
    assert any(".matcher.ema_var_q" in key for key in states["eager"])
    for key, want in states["eager"].items():
        torch.testing.assert_close(states["graphed"][key], want, rtol=1e-5, atol=1e-6, msg=key)

"""End-to-end through fairseq's own entry points on tiny generated data (CPU)."""
import json
import subprocess
import sys

import pytest
import torch
from fairseq_data import USER_DIR, make_lm_data, run

# end to end: fairseq's command lines on generated data; CI runs them through the quick-start, the README's
# train command and the GPU self-test on the CPU (tests/tools)
pytestmark = pytest.mark.extended

TRAIN_COMMON = ["--user-dir", USER_DIR, "--cpu", "--optimizer", "adam", "--lr", "1e-3", "--max-update", "6",
                "--log-format", "json", "--log-interval", "1", "--no-progress-bar", "--seed", "1",
                "--num-workers", "0", "--save-interval-updates", "3", "--no-epoch-checkpoints"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    return make_lm_data(tmp_path_factory.mktemp("lmdata"))


def train_lm(data, save_dir, attention, *extra):
    return run(["fairseq-train", data, "--task", "language_modeling", "--arch", "linattn_lm_tiny",
                "--decoder-attention-type", attention, "--tokens-per-sample", "64", "--batch-size", "8",
                "--save-dir", save_dir, *TRAIN_COMMON, "--lln-chunk-size", "16", "--lln-diag-block-size", "16",
                "--lavo-window", "16", *extra])


def train_losses(proc):
    return [json.loads(line.split("|")[-1]) for line in proc.stdout.splitlines() + proc.stderr.splitlines()
            if '"train_inner"' in line or ("| train_inner |" in line)]


@pytest.mark.parametrize("attention", ["lln", "lln_diag", "lavo", "softmax,lln"])
def test_lm_trains_and_evaluates_beyond_training_length(lm_data, tmp_path, attention):
    proc = train_lm(lm_data, tmp_path, attention)
    assert (tmp_path / "checkpoint_last.pt").exists()
    log = proc.stdout + proc.stderr
    assert '"loss"' in log and "nan" not in log.lower().replace("nan_", "")
    out = run(["fairseq-eval-lm", lm_data, "--path", tmp_path / "checkpoint_last.pt", "--user-dir", USER_DIR,
               "--cpu", "--tokens-per-sample", "128", "--max-tokens", "1024", "--context-window", "0",
               "--model-overrides", "{'tokens_per_sample': 128, 'max_target_positions': 128}",
               "--num-workers", "0", "--gen-subset", "valid"])
    ppl = float((out.stdout + out.stderr).split("Perplexity: ")[1].split()[0])
    assert 1 < ppl < 312  # finite, and better than uniform over the dictionary


def test_lm_resumes_from_checkpoint_last(lm_data, tmp_path):
    train_lm(lm_data, tmp_path, "lln")
    proc = train_lm(lm_data, tmp_path, "lln", "--max-update", "9")
    log = proc.stdout + proc.stderr
    assert "@ 6 updates)" in log  # "Loaded checkpoint .../checkpoint_last.pt (epoch 1 @ 6 updates)"
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    assert state["optimizer_history"][-1]["num_updates"] == 9


def test_roberta_masked_lm_trains_and_loads_with_from_pretrained(lm_data, tmp_path):
    run(["fairseq-train", lm_data, "--task", "masked_lm", "--criterion", "masked_lm",
         "--arch", "linattn_roberta_tiny", "--encoder-attention-type", "lln_diag", "--tokens-per-sample", "64",
         "--batch-size", "8", "--save-dir", tmp_path, "--lln-diag-block-size", "16", *TRAIN_COMMON])
    code = f"""
import fairseq_linattn, torch
from fairseq.models.roberta import RobertaModel
m = RobertaModel.from_pretrained({str(tmp_path)!r}, checkpoint_file='checkpoint_last.pt',
                                 data_name_or_path={str(lm_data)!r}, user_dir={USER_DIR!r}, bpe=None)
m.eval()
tokens = torch.tensor([[0, 5, 6, 7, 2]])
f = m.extract_features(tokens)
assert f.shape == (1, 5, 64) and torch.isfinite(f).all()
print(type(m.model.encoder.sentence_encoder.layers[0].self_attn).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LLNDiagAttention" in out.stdout


@pytest.mark.parametrize("args,message", [
    (["--decoder-attention-type", "skyformer"], "non-causal"),
    (["--decoder-attention-type", "lln,lln,lln"], "3 types"),
    (["--decoder-attention-type", "bogus"], "allowed: softmax"),
    (["--lavo-window", "0"], "--lavo-window"),
    (["--lln-alpha", "2"], "--lln-beta"),
    (["--lln-stats", "batch", "--decoder-attention-type", "lln"], "ema"),
])
def test_bad_options_stop_training_before_data_is_loaded(tmp_path, args, message):
    # the data directory does not exist: the error must come from option parsing, before loading
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(tmp_path / "missing"),
                           "--task", "language_modeling", "--arch", "linattn_lm_tiny", "--user-dir", USER_DIR,
                           "--cpu", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "No such file" not in proc.stderr and "FileNotFoundError" not in proc.stderr


def test_moment_matching_values_reach_tensorboard(lm_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = train_lm(lm_data, tmp_path / "ckpt", "lln", "--tensorboard-logdir", tmp_path / "tb")
    # the logs below are written, so no "Please install tensorboardX" (fairseq's text_to_speech task says it on
    # import, before the plugin loads, whenever tensorboardX is missing: setup.py installs it)
    assert "tensorboardX" not in proc.stdout + proc.stderr
    acc = EventAccumulator(str(tmp_path / "tb" / "train_inner"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "gnorm", "lln_alpha", "lln_beta", "lln_sigma_q", "lln_sigma_k", "lln_tau"} <= tags
    alphas = [e.value for e in acc.Scalars("lln_alpha")]
    assert len(alphas) >= 5 and all(0 < a <= 8 for a in alphas)
    valid = EventAccumulator(str(tmp_path / "tb" / "valid"))
    valid.Reload()
    assert "lln_alpha" in valid.Tags()["scalars"]


def test_attention_stats_interval_logs_entropy_and_spectral_gap(lm_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_lm(lm_data, tmp_path / "ckpt", "softmax,lln", "--tensorboard-logdir", tmp_path / "tb",
             "--attention-stats-interval", "2")
    acc = EventAccumulator(str(tmp_path / "tb" / "train_inner"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"attn_dec0_entropy", "attn_dec1_entropy", "attn_dec0_spectral_gap", "attn_dec1_alpha"} <= tags
    steps = [e.step for e in acc.Scalars("attn_dec0_entropy")]
    assert steps == [1, 3, 5]  # recorded on updates 0, 2, 4 (logged as the step after)

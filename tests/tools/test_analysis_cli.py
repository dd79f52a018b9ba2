"""`python -m linattn_tools.analysis`: synthetic mode, a checkpoint trained here, and bad input."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from fairseq_data import USER_DIR, make_lm_data, run

from linattn_tools.analysis.cli import main

MAX_PNG_BYTES = 200_000


def check_png(path):
    import matplotlib.image

    assert path.stat().st_size < MAX_PNG_BYTES
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 300
    assert float(image[..., :3].std()) > 0.05  # something is drawn


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """linattn_lm_tiny with a softmax and an LLN layer, 5 updates of fairseq-train."""
    root = tmp_path_factory.mktemp("analysis")
    data = make_lm_data(root)
    run(["fairseq-train", data, "--task", "language_modeling", "--arch", "linattn_lm_tiny",
         "--decoder-attention-type", "softmax,lln", "--tokens-per-sample", "64", "--batch-size", "8",
         "--save-dir", root / "ck", "--user-dir", USER_DIR, "--cpu", "--optimizer", "adam", "--lr", "1e-3",
         "--max-update", "5", "--no-progress-bar", "--seed", "1", "--num-workers", "0", "--no-epoch-checkpoints",
         "--lln-chunk-size", "16"])
    return root / "ck" / "checkpoint_last.pt", data


def test_synthetic_mode_reproduces_prop_3_1_and_moment_matching(tmp_path):
    out = tmp_path / "synthetic"
    proc = subprocess.run([sys.executable, "-m", "linattn_tools.analysis", "--synthetic", "--out", str(out),
                           "--seq-len", "128", "--num-matrices", "2", "--variances", "0.5", "1", "1.5"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "synthetic.json").read_text())
    points = {p["input_variance"]: p for p in report["points"]}
    assert sorted(points) == [0.5, 1.0, 1.5]
    one = points[1.0]
    assert one["softmax"]["log_p_var"] == pytest.approx(1.0, rel=0.1)  # Prop. 3.1: var ln P = sigma⁴
    assert one["softmax"]["log_p_mean"] == pytest.approx(-math.log(128) - 0.5, rel=0.05)
    assert one["lln_exact"]["log_p_var"] == pytest.approx(one["softmax"]["log_p_var"], rel=0.1)
    assert one["lln_paper"]["log_p_var"] == pytest.approx(one["softmax"]["log_p_var"], rel=0.25)
    assert one["lln_unmatched"]["log_p_var"] < 0.2 * one["softmax"]["log_p_var"]
    for method in ("softmax", "lln_exact"):  # hotter inputs concentrate attention (LLN Thm. 3.2)
        for measure in ("entropy", "spectral_gap"):
            values = [points[v][method][measure] for v in (0.5, 1.0, 1.5)]
            assert values[0] > values[1] > values[2]
            assert all(0 < x <= (math.log2(128) if measure == "entropy" else 1) + 1e-9 for x in values)
    for name in ("synthetic_var_log_p.png", "synthetic_log_p_hist.png", "synthetic_concentration.png"):
        check_png(out / name)
    assert proc.stdout.split() == [str(out / n) for n in ("synthetic.json", "synthetic_var_log_p.png",
                                                         "synthetic_log_p_hist.png", "synthetic_concentration.png")]


@pytest.mark.extended
def test_checkpoint_mode_measures_every_layer_and_head(trained, tmp_path):
    checkpoint, data = trained
    assert main([str(checkpoint), "--data", str(data), "--out", str(tmp_path), "--batches", "2",
                 "--batch-size", "4"]) == 0
    report = json.loads((tmp_path / "analysis.json").read_text())
    layers = report["layers"]
    assert [(layer["label"], layer["type"], layer["causal"]) for layer in layers] == [
        ("dec0", "softmax", True), ("dec1", "lln", True)]
    for layer in layers:
        assert layer["sequences"] == 8 and len(layer["heads"]) == layer["num_heads"] == 2
        for head in layer["heads"]:
            assert 0 < head["entropy"] <= head["entropy_max"] + 1e-9
            assert 0 < head["spectral_gap"] <= 1 + 1e-6
            assert 0 < head["sparsity"] <= 1 + 1e-9
            assert head["log_p_var"] > 0 and head["temperature_softmax"] > 0
    softmax_head = layers[0]["heads"][0]  # the softmax layer's own matrix is its softmax comparison
    assert softmax_head["log_p_rel_var"] == pytest.approx(softmax_head["log_p_rel_var_softmax"], rel=1e-4)
    assert "alpha" not in softmax_head
    # the decoder's LLN runs on its EMA statistics in eval: alpha, beta follow from the checkpoint's buffers
    from linattn.ops import lln_alpha_beta

    state = torch.load(checkpoint, weights_only=False)["model"]
    var_q, var_k = (state[f"decoder.layers.1.self_attn.matcher.ema_var_{x}"].item() for x in "qk")
    alpha, beta = lln_alpha_beta(math.sqrt(var_q), math.sqrt(var_k))
    lln_head = layers[1]["heads"][1]
    assert lln_head["alpha"] == pytest.approx(alpha, rel=1e-6) and lln_head["beta"] == pytest.approx(beta, rel=1e-6)
    assert lln_head["temperature_lln"] > 0
    for name in ("entropy_gap_per_layer.png", "log_p_histograms.png", "var_log_p_vs_input_variance.png"):
        check_png(tmp_path / name)


def stock_checkpoint(path, data):
    """A fairseq transformer_lm checkpoint (stock MultiheadAttention), built in-process."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
        "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2"])
    model = tasks.setup_task(args).build_model(args)
    torch.save({"cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
                "args": None, "model": model.state_dict(), "extra_state": {"train_iterator": {"epoch": 1}},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                       "lr_scheduler_state": {}, "num_updates": 0}]}, path)
    return path


@pytest.mark.extended
def test_bad_input_gives_one_clear_line_and_exit_code_2(trained, tmp_path, capsys):
    checkpoint, data = trained
    stock = stock_checkpoint(tmp_path / "stock.pt", data)
    not_a_checkpoint = tmp_path / "notes.pt"
    not_a_checkpoint.write_text("not a checkpoint")
    cases = [
        ([str(stock), "--data", str(data)], "has no fairseq_linattn attention (its attention modules: "
                                            "MultiheadAttention)"),
        ([str(tmp_path / "missing.pt"), "--data", str(data)], "checkpoint not found"),
        ([str(checkpoint)], "--data DIR is required"),
        ([str(checkpoint), "--data", str(tmp_path / "nodata")], "--data: directory not found"),
        ([str(checkpoint), "--data", str(data), "--split", "test"], "--split test: could not load it"),
        ([str(not_a_checkpoint), "--data", str(data)], "could not load checkpoint"),
    ]
    for argv, message in cases:
        assert main(argv + ["--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err
    for argv in ([], [str(checkpoint), "--synthetic"], ["--synthetic", "--batches", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv + ["--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2

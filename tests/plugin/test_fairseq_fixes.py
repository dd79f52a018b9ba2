"""Each fix of ``fairseq_linattn.fairseq_fixes`` is still needed (stock fairseq/torch/NumPy fail without it, in a
process without the plugin) and still works (the same step passes with the plugin imported)."""
import subprocess
import sys
import textwrap

from helpers import ROOT

CHECKPOINT = textwrap.dedent("""
    import argparse, sys, torch
    state = {"args": None, "cfg": None, "model": {"w": torch.ones(2)}, "last_optimizer_state": None,
             "optimizer_history": [{"criterion_name": "x", "optimizer_name": "adam", "num_updates": 0,
                                    "lr_scheduler_state": {"best": 1.0}}],
             "extra_state": {"epoch": 1, "args": argparse.Namespace(arch="linattn_lm_tiny")}}
    torch.save(state, sys.argv[1])
    if sys.argv[2] == "plugin":
        import fairseq_linattn
    from fairseq import checkpoint_utils
    loaded = checkpoint_utils.load_checkpoint_to_cpu(sys.argv[1])
    assert loaded["extra_state"]["args"].arch == "linattn_lm_tiny"
""")
NUMPY = textwrap.dedent("""
    import sys
    if sys.argv[1] == "plugin":
        import fairseq_linattn
    from fairseq.data import TokenBlockDataset
    import torch
    docs = [torch.tensor([5, 6, 1]), torch.tensor([7, 1])]
    dataset = TokenBlockDataset(docs, [3, 2], block_size=None, pad=0, eos=1, break_mode="eos")
    assert len(dataset) == 2 and dataset[1].tolist() == [7, 1]
""")
BF16 = textwrap.dedent("""
    import sys
    if sys.argv[1] == "plugin":
        import fairseq_linattn
    from fairseq import options
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [sys.argv[2], "--task", "language_modeling", "--arch",
                                                "transformer_lm", "--bf16"])
    assert args.bf16
    print("tpu", args.tpu)
""")


def run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_fairseq_checkpoints_load_on_this_torch_only_with_the_fix(tmp_path):
    stock = run(CHECKPOINT, str(tmp_path / "a.pt"), "stock")
    assert stock.returncode != 0 and "weights_only" in stock.stderr, "fix no longer needed: " + stock.stderr[-2000:]
    fixed = run(CHECKPOINT, str(tmp_path / "b.pt"), "plugin")
    assert fixed.returncode == 0, fixed.stderr[-3000:]


def test_token_block_datasets_build_on_this_numpy_only_with_the_fix():
    stock = run(NUMPY, "stock")
    assert stock.returncode != 0 and "compat" in stock.stderr, "fix no longer needed: " + stock.stderr[-2000:]
    fixed = run(NUMPY, "plugin")
    assert fixed.returncode == 0, fixed.stderr[-3000:]


def test_bf16_stays_off_the_tpu_path_without_torch_xla_only_with_the_fix(tmp_path):
    stock = run(BF16, "stock", str(tmp_path))
    assert stock.returncode == 0 and "tpu True" in stock.stdout, "fix no longer needed: " + stock.stderr[-2000:]
    fixed = run(BF16, "plugin", str(tmp_path))
    assert fixed.returncode == 0 and "tpu False" in fixed.stdout, fixed.stderr[-3000:]

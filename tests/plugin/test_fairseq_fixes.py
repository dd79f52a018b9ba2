"""Each fix of ``fairseq_linattn.fairseq_fixes`` is still needed (stock fairseq/torch/NumPy fail without it, in a
process without the plugin) and still works (the same step passes with the plugin imported)."""
import json
import subprocess
import sys
import textwrap

import pytest
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


# Each mode's three steps run one after another in one process, as ``python -c`` would run each (the plugin
# imported first with "plugin"): two processes, not six (fairseq's import is most of a step's 3 s)
DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    out = {}
    for name, code, *argv in json.loads(sys.argv[1]):
        stdout, stderr, status = io.StringIO(), io.StringIO(), 0
        sys.argv = ["-c", *argv]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            except SystemExit as exit:
                status = exit.code if isinstance(exit.code, int) else (exit.code is not None)
            except BaseException:
                status, _ = 1, stderr.write(traceback.format_exc())
        out[name] = (status, stdout.getvalue(), stderr.getvalue())
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """{mode: {step: (exit status, stdout, stderr)}} for mode "stock" (no plugin) and "plugin"."""
    tmp = tmp_path_factory.mktemp("fixes")
    out = {}
    for mode in ("stock", "plugin"):
        cases = [("checkpoint", CHECKPOINT, str(tmp / f"{mode}.pt"), mode), ("numpy", NUMPY, mode),
                 ("bf16", BF16, mode, str(tmp))]
        run = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        out[mode] = {name: tuple(v) for name, v in json.loads(run.stdout.splitlines()[-1]).items()}
    return out


def test_fairseq_checkpoints_load_on_this_torch_only_with_the_fix(steps):
    code, _, err = steps["stock"]["checkpoint"]
    assert code != 0 and "weights_only" in err, "fix no longer needed: " + err[-2000:]
    code, _, err = steps["plugin"]["checkpoint"]
    assert code == 0, err[-3000:]


def test_token_block_datasets_build_on_this_numpy_only_with_the_fix(steps):
    code, _, err = steps["stock"]["numpy"]
    assert code != 0 and "compat" in err, "fix no longer needed: " + err[-2000:]
    code, _, err = steps["plugin"]["numpy"]
    assert code == 0, err[-3000:]


def test_bf16_stays_off_the_tpu_path_without_torch_xla_only_with_the_fix(steps):
    code, out, err = steps["stock"]["bf16"]
    assert code == 0 and "tpu True" in out, "fix no longer needed: " + err[-2000:]
    code, out, err = steps["plugin"]["bf16"]
    assert code == 0 and "tpu False" in out, err[-3000:]

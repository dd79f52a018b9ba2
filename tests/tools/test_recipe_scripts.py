"""The recipe scripts (scripts/*.sh): help, usage, attention checks against the registry, launch, glibc settings."""
import os
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT

SCRIPTS = ["pretrain_wikitext103.sh", "finetune_glue.sh", "train_pg19.sh", "eval_pg19.sh", "glue_all.sh",
           "quickstart.sh"]


POSITIONALS = {"pretrain_wikitext103.sh": ["ATTN"], "finetune_glue.sh": ["TASK", "ATTN", "CHECKPOINT"],
               "train_pg19.sh": ["ATTN"], "eval_pg19.sh": ["CHECKPOINT"], "glue_all.sh": ["ATTN", "CHECKPOINT"],
               "quickstart.sh": []}
ROLES = {"pretrain_wikitext103.sh": "encoder", "finetune_glue.sh": "encoder", "glue_all.sh": "encoder",
         "train_pg19.sh": "decoder"}

FAKE_PYTHON = """#!/bin/sh
# a stand-in python: records every call; stubs the registry check and torchrun; else the real python
echo "$*" >> "$FAKE_CALLS"
case "$1 $2" in
  "-m linattn_tools.methods_cli")
    [ "${FAKE_CHECK_EXIT:-0}" = 0 ] || echo "--x-attention-type: invalid attention type; allowed: ..." >&2
    exit "${FAKE_CHECK_EXIT:-0}";;
  "-m torch.distributed.run") shift 2; printf '%s\\n' torchrun "$@" > "$FAKE_ARGV"; echo "torchrun $FAKE_TAG"; exit 0;;
esac
[ -n "${FAKE_REAL:-}" ] || { echo "no python here" >&2; exit 1; }
exec "$FAKE_REAL" "$@"
"""
FAKE_TRAIN = """#!/bin/sh
printf '%s\\n' fairseq-train "$@" > "$FAKE_ARGV"; echo "fairseq-train $FAKE_TAG"
"""


@pytest.fixture
def fake_python(tmp_path):
    """(env, calls file, argv file): the venv's python (VENV/bin) and the first python(3) on PATH are a stand-in
    that records its calls (and runs nothing else unless FAKE_REAL is set); fairseq-train beside it its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("python3", FAKE_PYTHON), ("fairseq-train", FAKE_TRAIN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls, argv = tmp_path / "calls.txt", tmp_path / "argv.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "SAMPLE", "GPUS_PER_NODE", "OUT", "DATA")}
    env.update(VENV=str(tmp_path), PATH=f"{bin_dir}:/usr/bin:/bin", FAKE_CALLS=str(calls),
               FAKE_ARGV=str(argv))
    return env, calls, argv


def run_script(script, *args, env, timeout=120):
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_explains_itself_with_help(script):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage:")
    if script != "quickstart.sh":
        assert "DEVICE" in proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_no_python(script, fake_python):
    env, calls, _ = fake_python  # the only python on PATH (and VENV's) fails and says it was called
    for flag in ("--help", "-h"):
        proc = run_script(script, flag, env={**env, "DEVICE": "gpu"}, timeout=30)
        assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: {'bash ' * (script == 'quickstart.sh')}"
                                                               f"scripts/{script}"), proc.stderr
        usage_line = proc.stdout.splitlines()[0]
        assert all(name in usage_line for name in POSITIONALS[script]), usage_line
        if script != "quickstart.sh":
            assert "options...]" in usage_line  # what the arguments after the positional ones go to
            assert "DEVICE" in proc.stdout and "OUT" in proc.stdout
    assert not calls.exists(), calls.read_text()


def test_too_few_arguments_print_the_usage_to_stderr(fake_python):
    env, calls, _ = fake_python
    for script, args in (("finetune_glue.sh", ["mnli", "lln"]), ("glue_all.sh", ["lln"]), ("train_pg19.sh", [])):
        proc = run_script(script, *args, env=env, timeout=30)
        assert proc.returncode == 2 and proc.stderr.startswith(f"Usage: scripts/{script}") and not proc.stdout
    proc = run_script("train_pg19.sh", "--max-update", "5", env=env, timeout=30)  # fairseq options, no ATTN
    assert proc.returncode == 2 and "expected ATTN" in proc.stderr
    assert not calls.exists()


@pytest.mark.parametrize("script", sorted(ROLES))
def test_scripts_ask_the_registry_for_their_attention_role_before_doing_anything(script, fake_python, tmp_path):
    env, calls, argv = fake_python
    args = {"finetune_glue.sh": ["mnli", "flash", "ckpt.pt"], "glue_all.sh": ["flash", "ckpt.pt"]}.get(script,
                                                                                              ["flash"])
    env = {**env, "FAKE_CHECK_EXIT": "2", "DEVICE": "cpu", "SAMPLE": "1", "SAMPLE_DATA": str(tmp_path / "none")}
    proc = run_script(script, *args, env=env, timeout=30)
    assert proc.returncode == 2 and "--x-attention-type: invalid" in proc.stderr  # the registry's message
    assert calls.read_text().splitlines() == [f"-m linattn_tools.methods_cli check --role {ROLES[script]} flash"]
    assert not argv.exists() and not (tmp_path / "none").exists()


def test_check_attention_says_so_when_the_registry_cannot_answer(fake_python):
    env, _, _ = fake_python  # the check fails otherwise than with a verdict (exit 1, not 0 or 2)
    proc = subprocess.run(["bash", "-c", f"source {ROOT / 'scripts' / 'recipe_lib.sh'}; check_attention decoder lavo"],
                          capture_output=True, text=True, env={**env, "FAKE_CHECK_EXIT": "1"}, timeout=30)
    assert proc.returncode == 2 and "could not check the decoder attention type 'lavo'" in proc.stderr
    assert "--x-attention-type: invalid" in proc.stderr  # with what it printed


def test_check_attention_asks_the_registry_per_role():
    def check(role, spec):
        return subprocess.run(["bash", "-c", f'source "{ROOT / "scripts" / "recipe_lib.sh"}"; check_attention "$@"',
                               "-", role, spec], capture_output=True, text=True, timeout=120)

    for role, spec in (("encoder", "lln"), ("encoder", "softmax,lln_diag"), ("encoder", "skyformer"),
                       ("decoder", "lavo"), ("decoder", "softmax,lln")):
        proc = check(role, spec)
        assert proc.returncode == 0, (role, spec, proc.stderr)
    proc = check("encoder", "flash")
    assert proc.returncode == 2 and "--encoder-attention-type" in proc.stderr and "softmax" in proc.stderr
    proc = check("decoder", "skyformer")  # non-causal: not a decoder type
    assert proc.returncode == 2 and "--decoder-attention-type" in proc.stderr


def test_scripts_reject_an_unknown_attention_before_doing_anything(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "SAMPLE": "1", "SAMPLE_DATA": str(tmp_path / "none")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train_pg19.sh"), "flash"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "allowed: softmax" in proc.stderr
    assert not (tmp_path / "none").exists()


def test_a_rerun_starts_a_fresh_train_log_and_keeps_the_earlier_ones(fake_python, tmp_path):
    env, calls, argv = fake_python
    (tmp_path / "data").mkdir()
    out = tmp_path / "out"
    env = {**env, "FAKE_REAL": sys.executable, "DEVICE": "cpu", "DATA": str(tmp_path / "data"), "OUT": str(out)}
    for tag in ("first", "second", "third"):
        proc = run_script("pretrain_wikitext103.sh", "lln", "--max-update", "5", env={**env, "FAKE_TAG": tag})
        assert proc.returncode == 0, proc.stderr
    assert (out / "train.log").read_text() == "fairseq-train third\n"
    assert (out / "train.log.1").read_text() == "fairseq-train first\n"  # numbered in the order written
    assert (out / "train.log.2").read_text() == "fairseq-train second\n"
    args = argv.read_text().splitlines()
    assert args[:2] == ["fairseq-train", str(tmp_path / "data")] and "--cpu" in args
    assert args[args.index("--encoder-attention-type") + 1:][:3] == ["lln", "--max-update", "5"]  # user's last
    assert args[args.index("--save-dir") + 1] == str(out) and args[-2:] == ["--distributed-world-size", "1"]
    assert not any(call.startswith("-c") for call in calls.read_text().splitlines())  # no GPU count on the CPU


def test_more_than_one_gpu_launches_torchrun_and_counts_gpus_only_when_launching(fake_python, tmp_path):
    env, calls, argv = fake_python
    (tmp_path / "data").mkdir()
    env = {**env, "FAKE_REAL": sys.executable, "DEVICE": "gpu", "DATA": str(tmp_path / "data"),
           "OUT": str(tmp_path / "out"), "GPUS_PER_NODE": "2", "NNODES": "2", "MASTER_ADDR": "node0"}
    proc = run_script("train_pg19.sh", "lavo", env=env)
    assert proc.returncode == 0, proc.stderr
    args = argv.read_text().splitlines()
    assert args[:11] == ["torchrun", "--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "2", "--master_addr",
                         "node0", "--master_port", "29500"]
    assert "--fp16" in args and args[args.index("--update-freq") + 1] == "4"  # 8192 x 4 GPUs x 4 = 2^17
    assert args[-2:] == ["--distributed-world-size", "4"] and "--cpu" not in args
    assert not any(call.startswith("-c") for call in calls.read_text().splitlines())  # GPUS_PER_NODE given
    env.pop("GPUS_PER_NODE")
    proc = run_script("train_pg19.sh", "lavo", env={**env, "NNODES": "1"})
    assert proc.returncode == 0, proc.stderr
    assert sum(call.startswith("-c import torch") for call in calls.read_text().splitlines()) == 1


def test_dry_run_prints_the_torchrun_command_of_a_second_node_and_runs_nothing(tmp_path):
    """NODE_RANK reaches torchrun (static rendezvous at node 0's MASTER_ADDR:MASTER_PORT); DRY_RUN=1 only prints."""
    (tmp_path / "data").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "SAMPLE", "OUT", "DATA")}
    env.update(DEVICE="gpu", DATA=str(tmp_path / "data"), OUT=str(tmp_path / "out"), DRY_RUN="1", NNODES="2",
               NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29600", GPUS_PER_NODE="4")
    proc = run_script("train_pg19.sh", "lln", env=env)
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(next(line for line in proc.stdout.splitlines() if "torch.distributed.run" in line))
    assert args[1:3] == ["-m", "torch.distributed.run"]
    launcher = dict(zip(args[3:13:2], args[4:13:2]))
    assert launcher == {"--nnodes": "2", "--node_rank": "1", "--nproc_per_node": "4", "--master_addr": "10.1.2.3",
                        "--master_port": "29600"}
    assert args[13:15] == ["-m", "fairseq_cli.train"] and args[-2:] == ["--distributed-world-size", "8"]
    assert args[args.index("--save-dir") + 1] == str(tmp_path / "out") and not (tmp_path / "out").exists()
    proc = run_script("train_pg19.sh", "lln", env={**env, "NODE_RANK": "2"})
    assert proc.returncode == 2 and "NODE_RANK must be an integer in [0, NNODES = 2)" in proc.stderr


def test_dry_run_prints_the_command_before_the_data_exists_and_a_real_run_refuses(tmp_path):
    """The README's GPU example: DRY_RUN=1 prints the full fairseq-train line while the data is still to be
    prepared (a note names the missing directory); without DRY_RUN the same call stops there, running nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "SAMPLE", "OUT", "DATA")}
    env.update(DEVICE="gpu", GPUS_PER_NODE="1", DATA=str(tmp_path / "missing"), OUT=str(tmp_path / "out"), DRY_RUN="1")
    proc = run_script("pretrain_wikitext103.sh", "lln", env=env)
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(proc.stdout.splitlines()[0])
    assert args[0].endswith("fairseq-train") and args[1] == str(tmp_path / "missing")
    assert args[args.index("--encoder-attention-type") + 1] == "lln" and "--fp16" in args
    assert f"note: no data directory {tmp_path / 'missing'} yet" in proc.stderr
    env.pop("DRY_RUN")
    proc = run_script("pretrain_wikitext103.sh", "lln", env=env)
    assert proc.returncode != 0 and f"no data directory {tmp_path / 'missing'}" in proc.stderr
    assert not (tmp_path / "out").exists()


# --- reports ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, preset, expected", [("cpu", None, str(2 ** 40)), ("cpu", "65536", "65536"),
                                                      ("gpu", None, "")])
def test_cpu_recipes_have_glibc_keep_freed_memory_unless_the_user_says_otherwise(device, preset, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["DEVICE"] = device
    if preset is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = preset
    out = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/recipe_lib.sh; echo \"$MALLOC_MMAP_THRESHOLD_\";"
                          " bash -c 'echo \"$MALLOC_TRIM_THRESHOLD_\"'"], env=env, capture_output=True, text=True)
    mmap, trim = out.stdout.splitlines()
    assert mmap == expected and trim == ("" if device == "gpu" else str(2 ** 40))  # exported to child processes


def test_cpu_ddp_ranks_keep_freed_memory_unless_the_user_says_otherwise():
    from linattn_tools.malloc import KEEP_FREED_MEMORY, keeping_freed_memory

    assert keeping_freed_memory({"A": "1"}) == {"A": "1", **KEEP_FREED_MEMORY}
    assert keeping_freed_memory({"MALLOC_TRIM_THRESHOLD_": "7"})["MALLOC_TRIM_THRESHOLD_"] == "7"

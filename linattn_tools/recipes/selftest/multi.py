"""The ``multi_gpu`` stage: 2 data-parallel ranks against 1 process with the same global batch, a few updates of
the sample RoBERTa with LLN and LLN+Diag layers, dropout off, EMA moment statistics (every layer's folded from one
all-reduce per update, so both ranks' forwards use one process's alpha, beta; ``batch`` statistics would be each
rank's own in a training forward, as batch normalisation's, docs/design.md §3.1), one sentence per sample and
grouped shuffling (so that the ranks' batches of an update are the two halves of the
1-process batch).

On CUDA (>= 2 GPUs) the ranks start as the recipes start them (``torch.distributed.run``, c10d rendezvous, NCCL);
on the CPU with ``python -m linattn_tools.cpu_ddp`` (2 gloo processes, the recipes' CPU data-parallel launch). The
ranks run ``selftest.rank_train`` (fairseq-train where every rank writes its checkpoint). Verdicts:
- the moment-matching buffers (``running_var_*``, ``ema_var_*``) are bitwise identical on both ranks;
- they equal the 1-process run's (relative error <= ``STATS_RTOL``: float64 sums in another order);
- every update's loss matches the 1-process run's within ``LOSS_ATOL`` (fairseq logs it with 3 decimals), and
  both runs report the same batch size per update.
"""
import sys
from pathlib import Path

from .. import config as recipe_config
from .. import report
from .core import ROOT, Settings, Stage, child_env, run_logged, tail
from .ops import rel_err

ATTENTION = "lln,lln_diag"
STATS_RTOL = 1e-5
LOSS_ATOL = 2e-3
PER_RANK = 4
RANK_TRAIN = "linattn_tools.recipes.selftest.rank_train"


def train_args(settings: Settings, devices: int, per_device: int) -> list:
    config = recipe_config.load(ROOT / "configs" / "pretrain_wikitext103.yaml", sample=True)
    data = settings.samples / recipe_config.get(config, "data")
    args = recipe_config.fairseq_args(config, devices, fp16=False, per_device=per_device, update_freq=1)
    return [str(data), *args, "--encoder-attention-type", ATTENTION, "--lln-stats", "ema", "--max-update", "3",
            "--dropout", "0", "--attention-dropout", "0", "--sample-break-mode", "eos", "--grouped-shuffling",
            "--required-batch-size-multiple", "1", "--disable-validation", "--seed", "1", "--log-format", "json",
            "--log-interval", "1", "--user-dir", str(ROOT / "fairseq_linattn")] + ([] if settings.cuda else ["--cpu"])


def commands(settings: Settings, out: Path) -> dict:
    """{"2 ranks": argv, "1 process": argv}."""
    from linattn_tools.cpu_ddp import free_port

    two = train_args(settings, 2, PER_RANK) + ["--save-dir", str(out / "two")]
    one = train_args(settings, 1, 2 * PER_RANK) + ["--save-dir", str(out / "one"), "--distributed-world-size", "1"]
    if settings.cuda:  # the recipes' torchrun launch (scripts/recipe_lib.sh), one node
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                  "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{free_port()}", "--rdzv_id", "selftest",
                  "-m", RANK_TRAIN, *two, "--distributed-world-size", "2"]
    else:
        launch = [sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--train-command",
                  f"{sys.executable} -m {RANK_TRAIN}", "--", *two]
    return {"2 ranks": launch, "1 process": [sys.executable, "-m", RANK_TRAIN, *one]}


def multi_stage(settings: Settings) -> Stage:
    from .training import matcher_buffers

    backend = "NCCL, torchrun" if settings.cuda else "gloo, python -m linattn_tools.cpu_ddp"
    stage = Stage("multi_gpu", note=f"{ATTENTION} RoBERTa sample, 2 ranks x {PER_RANK} vs 1 process x "
                  f"{2 * PER_RANK} sequences, 3 updates in fp32 ({backend})")
    if settings.cuda and settings.gpus < 2:
        stage.add("2 ranks", "SKIP", f"{settings.gpus} GPU visible", ">= 2 GPUs")
        return stage
    out = settings.stage_dir("multi_gpu")
    env = child_env(**({} if settings.cuda else {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}))
    for name, cmd in commands(settings, out).items():
        (out / ("two" if name == "2 ranks" else "one")).mkdir(exist_ok=True)
        log = out / f"{name.replace(' ', '_')}.log"
        code = run_logged(cmd, log, env)
        if code != 0:
            stage.judge(f"{name} ran", False, f"exit {code}", "exit 0", tail(log))
            return stage
    ranks = [matcher_buffers(out / "two" / "checkpoint_last.pt"),
             matcher_buffers(out / "two" / "checkpoint_last-rank1.pt")]
    single = matcher_buffers(out / "one" / "checkpoint_last.pt")
    if not ranks[0] or ranks[0].keys() != ranks[1].keys() or ranks[0].keys() != single.keys():
        stage.judge("moment statistics found", False, f"{[len(r) for r in ranks]} / {len(single)} buffers",
                    "the same buffers in every checkpoint")
        return stage
    differ = [k for k in ranks[0] if not bool((ranks[0][k] == ranks[1][k]).all())]
    stage.judge("moment statistics rank 0 == rank 1", not differ, f"{len(differ)} of {len(ranks[0])} buffers differ",
                "bitwise identical", ", ".join(differ[:3]))
    worst = max(ranks[0], key=lambda k: rel_err(ranks[0][k], single[k]))
    err = rel_err(ranks[0][worst], single[worst])
    stage.judge("moment statistics 2 ranks == 1 process (union batch)", err <= STATS_RTOL, err,
                f"<= {STATS_RTOL:g} (relative)", f"worst buffer {worst}")
    logs = [report.read_log(out / f"{name}.log")["train_inner"] for name in ("2_ranks", "1_process")]
    losses = [[r.get("loss") for r in log] for log in logs]
    sizes = [[r.get("bsz") for r in log] for log in logs]
    if len(losses[0]) != 3 or len(losses[1]) != 3:
        stage.judge("loss per update", False, f"{len(losses[0])} / {len(losses[1])} updates logged", "3 each")
        return stage
    gap = max(abs(a - b) for a, b in zip(*losses))
    stage.judge("loss 2 ranks vs 1 process", gap <= LOSS_ATOL and sizes[0] == sizes[1], gap,
                f"<= {LOSS_ATOL:g} per update (logged with 3 decimals); same batch sizes",
                f"losses {losses[0]} vs {losses[1]}; batch sizes {sizes[0]} vs {sizes[1]}")
    return stage

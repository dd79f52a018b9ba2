"""The moment statistics across data-parallel ranks under fairseq's trainer (fairseq_linattn/moment_sync.py): every
layer's statistics in one all-reduce per update, none at world size 1, the folded statistics those of one process
over the union batch, and an attempt fairseq skips folds nothing."""
import json
import os
import subprocess
import sys
import textwrap

import torch
from helpers import ROOT
from torch import nn

from fairseq_linattn.modules.moment_matcher import MomentMatcher, folds_deferred
from fairseq_linattn.moment_sync import fold_moment_statistics
from linattn_tools import cpu_ddp

BUFFERS = ("running_var_q", "running_var_k", "running_batches", "ema_var_q", "ema_var_k")


def layers() -> nn.Module:
    """Three matchers as three LLN layers would have: per layer and per head, batch and EMA statistics."""
    return nn.ModuleList([MomentMatcher(head_dim=4, num_heads=2, stats="batch"),
                          MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats="ema", ema_momentum=0.5),
                          MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats="batch")]).train()


def forward(model, q, k, mask) -> None:
    """One training forward of every layer, each on its own inputs (as layers see different activations)."""
    for i, m in enumerate(model):
        m((i + 1) * q, k + i, mask)


def state(model) -> dict:
    return {f"{i}.{n}": getattr(m, n).tolist() for i, m in enumerate(model) for n in BUFFERS if hasattr(m, n)}


RANK = """
import json, sys
import torch, torch.distributed as dist
from tests_moment_sync_rank import run
rank, port, data = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
print(json.dumps(run(rank, data)), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def run(rank: int, data: str) -> dict:
    """A rank's update: a skipped attempt on a batch it then drops, the real one, one fold; counts collectives."""
    import torch.distributed as dist

    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    q, k, mask = torch.load(data)[rank]
    torch.manual_seed(0)
    model = layers()
    with folds_deferred():
        forward(model, 5 * q, k, mask)  # an attempt fairseq skips (overflow): no optimizer step, no fold
    model.train()  # fairseq's next attempt starts with model.train()
    with folds_deferred():
        forward(model, q, k, mask)
        alpha = model[0].last_alpha.tolist()  # the forward's own alpha: this rank's statistics
    collectives = fold_moment_statistics(model, None, dist.get_world_size())
    return {"state": state(model), "collectives": collectives, "all_reduce_calls": calls, "alpha": alpha}


def shard(gen, scale):
    q = scale * torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64)
    k = 2 * scale * torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64) + 0.5
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, 6:] = True  # right padding
    mask[2, :4] = True  # left padding
    return q, k, mask


def one_process(q, k, mask) -> dict:
    model = layers()
    with folds_deferred():
        forward(model, q, k, mask)
        alpha = model[0].last_alpha.tolist()
    collectives = fold_moment_statistics(model, None, 1)
    return {"state": state(model), "collectives": collectives, "alpha": alpha}


def test_two_gloo_ranks_fold_the_union_batch_in_one_all_reduce(tmp_path, gen):
    shards = [shard(gen, 1.0), shard(gen, 3.0)]  # different scales: a rank's own statistics would show
    torch.save(shards, tmp_path / "shards.pt")
    (tmp_path / "tests_moment_sync_rank.py").write_text(
        "from test_moment_sync import run  # noqa: F401\n")
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(__file__), str(ROOT / "tests"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    port = str(cpu_ddp.free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path / "shards.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ranks = [json.loads(out) for out, _ in outs]
    union = one_process(*(torch.cat(parts) for parts in zip(*shards)))
    alone = one_process(*shards[0])
    assert union["collectives"] == 0  # world size 1: no collective
    assert union["state"] != alone["state"]  # the shards' statistics differ
    for r, result in enumerate(ranks):
        assert result["collectives"] == 1 and len(result["all_reduce_calls"]) == 1, result["all_reduce_calls"]
        assert result["all_reduce_calls"][0] == 5 * (1 + 2 + 2)  # every layer's moments in the one tensor
        for key, want in union["state"].items():
            torch.testing.assert_close(torch.tensor(result["state"][key]), torch.tensor(want), rtol=1e-12, atol=0,
                                       msg=f"rank {r} {key}")
    assert ranks[0]["alpha"] == alone["alpha"]  # the forward itself used rank 0's own batch


class _Scaler:
    def __init__(self, overflow: bool):
        self.scale, self.overflow = 128.0, overflow

    def get_scale(self) -> float:
        return self.scale


class _Optimizer:
    """fairseq's optimizer as the task's ``optimizer_step`` sees it; ``amp``: with --amp's grad scaler, which halves
    its scale when it skips an overflowing step."""

    def __init__(self, amp_overflow=None):
        self.steps = 0
        if amp_overflow is not None:
            self.scaler = _Scaler(amp_overflow)

    def step(self):
        self.steps += 1
        if hasattr(self, "scaler") and self.scaler.overflow:
            self.scaler.scale /= 2


def test_fairseqs_optimizer_step_folds_the_update_once_and_not_a_skipped_amp_step(gen):
    from fairseq.tasks import FairseqTask

    import fairseq_linattn  # noqa: F401  (extends FairseqTask)

    q, k, mask = shard(gen, 2.0)
    for optimizer, folds in ((_Optimizer(), 1), (_Optimizer(amp_overflow=False), 1), (_Optimizer(True), 0)):
        model = layers()
        with folds_deferred():  # what the extended train_step does around each micro-batch
            forward(model, q, k, mask)
            forward(model, q, k, mask)  # a second micro-batch (--update-freq 2): the same update
        FairseqTask.optimizer_step(None, optimizer, model, update_num=0)
        assert optimizer.steps == 1
        assert int(model[0].running_batches) == folds and int(model[2].running_batches) == folds
        assert (model[1].ema_var_q != 1).all() == bool(folds)
        assert not model[0].pending_moments.any() or not folds

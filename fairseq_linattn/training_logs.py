"""Route the plugin's per-layer statistics through fairseq's logging outputs.

fairseq all-reduces (or all-gathers) every numeric entry of a criterion's ``logging_output`` across
workers and then calls ``task.reduce_metrics``. We extend ``FairseqTask.train_step`` /
``valid_step`` to add ``linattn_<name>_sum`` and ``linattn_count`` entries taken from the model's
attention modules after each forward, and ``FairseqTask.reduce_metrics`` to log
``<name> = sum / count`` with ``metrics.log_scalar``: worker-averaged values that land in
``--tensorboard-logdir`` next to ``loss``, ``lr`` and ``gnorm``. Models without plugin attention add
nothing, so stock models are unaffected. The same extension defers the moment matchers' folds during
``train_step`` and folds them in ``optimizer_step``: one all-reduce per update for all layers (``moment_sync``).
"""
import contextlib
from typing import Dict

import torch
from fairseq import metrics
from fairseq.tasks import FairseqTask

from . import moment_sync
from .modules.moment_matcher import folds_deferred, statistics_left_out

PREFIX = "linattn_"


def attention_stats(model) -> Dict[str, torch.Tensor]:
    """Mean over the model's LLN layers of sigma_q, sigma_k, alpha, beta, tau (from the last forward)."""
    from .modules.lln import LLNAttention

    names = ("sigma_q", "sigma_k", "alpha", "beta", "tau")
    rows = []
    for module in model.modules():
        matcher = getattr(module, "matcher", None) if isinstance(module, LLNAttention) else None
        if matcher is not None and matcher.last_alpha is not None:
            rows.append(torch.stack([getattr(matcher, "last_" + n).double().mean() for n in names]))
    if not rows:
        return {}
    means = torch.stack(rows).mean(0)  # tensors: fairseq reads logging outputs on the host once per logged update
    return {"lln_" + n: means[i] for i, n in enumerate(names)}


def _add_stats(model, logging_output: dict) -> None:
    from .analysis.training_stats import collect_attention_stats  # the --attention-stats-interval recorder

    stats = {**attention_stats(model), **collect_attention_stats(model)}
    if stats:
        for name, value in stats.items():
            logging_output[f"{PREFIX}{name}_sum"] = value
        logging_output[f"{PREFIX}count"] = 1


def _reduce(logging_outputs) -> None:
    count = sum(log.get(f"{PREFIX}count", 0) for log in logging_outputs)
    if not count:
        return
    names = {key[len(PREFIX):-4] for log in logging_outputs for key in log
             if key.startswith(PREFIX) and key.endswith("_sum")}
    for name in sorted(names):
        total = sum(log.get(f"{PREFIX}{name}_sum", 0) for log in logging_outputs)
        metrics.log_scalar(name, float(total) / count, weight=count, round=4)


def log_statistics_through_tasks() -> None:
    """Idempotently extend FairseqTask's train_step, valid_step, reduce_metrics and optimizer_step.

    Why the plugin extends fairseq's base task rather than wrapping something: the statistics must reach
    every task's logging outputs (masked_lm, language_modeling, sentence_prediction, translation, ...)
    so that fairseq all-reduces them with the loss. fairseq 0.12 offers no hook between a forward and
    its logging output: a criterion or task wrapper would need a new registered name per criterion or
    task and a changed command line, and ``metrics.log_scalar`` from the model is per-rank, not
    worker-averaged. This is the only place where the plugin changes a fairseq class.
    """
    if getattr(FairseqTask, "_linattn_metrics", False):
        return
    train_step, valid_step, reduce_metrics = FairseqTask.train_step, FairseqTask.valid_step, FairseqTask.reduce_metrics
    optimizer_step = FairseqTask.optimizer_step

    def train_step_with_stats(self, sample, model, *args, **kwargs):
        # fairseq's dummy batch (a rank without data; ignore_grad=True): it adds no moments to the statistics
        dummy = kwargs.get("ignore_grad", args[3] if len(args) > 3 else False)
        with statistics_left_out() if dummy else contextlib.nullcontext(), folds_deferred():
            loss, sample_size, logging_output = train_step(self, sample, model, *args, **kwargs)
        _add_stats(model, logging_output)
        return loss, sample_size, logging_output

    def optimizer_step_with_folds(self, optimizer, model, update_num):
        # the update's moment statistics, all layers in one all-reduce, folded only if the step was taken
        before = moment_sync.loss_scale(optimizer)
        optimizer_step(self, optimizer, model, update_num)
        after = moment_sync.loss_scale(optimizer)
        if before is None or after >= before:  # --amp lowers its scale when it skips an overflowing step
            moment_sync.fold_moment_statistics(model, *moment_sync.data_parallel_group())

    def valid_step_with_stats(self, sample, model, *args, **kwargs):
        loss, sample_size, logging_output = valid_step(self, sample, model, *args, **kwargs)
        _add_stats(model, logging_output)
        return loss, sample_size, logging_output

    def reduce_metrics_with_stats(self, logging_outputs, criterion):
        reduce_metrics(self, logging_outputs, criterion)
        _reduce(logging_outputs)

    FairseqTask.train_step = train_step_with_stats
    FairseqTask.valid_step = valid_step_with_stats
    FairseqTask.reduce_metrics = reduce_metrics_with_stats
    FairseqTask.optimizer_step = optimizer_step_with_folds
    FairseqTask._linattn_metrics = True

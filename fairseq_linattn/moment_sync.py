"""The moment matchers' statistics across data-parallel ranks: one all-reduce per update for every layer.

Under fairseq's trainer, each training forward adds its batch's moments to its matcher's ``pending_moments``
(``folds_deferred``); after the optimizer step, ``fold_moment_statistics`` all-reduces every layer's pending moments
in one flat tensor on fairseq's data-parallel group (none at world size 1) and folds them into the running
statistics, so every rank keeps the same statistics, those of the union batch. An update fairseq skips (gradient
overflow, out of memory) reaches no optimizer step, hence no collective; its moments are dropped when the next
attempt calls ``model.train()`` (docs/design.md §3.1).
"""
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .modules.moment_matcher import MomentMatcher


def matchers(model: nn.Module) -> List[MomentMatcher]:
    """The model's moment matchers, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, MomentMatcher)]


def fold_moment_statistics(model: nn.Module, group=None, world_size: int = 1) -> int:
    """All-reduce (one collective, on ``group``, when ``world_size`` > 1) and fold every matcher's pending moments;
    returns the number of collectives issued (0 or 1)."""
    found = matchers(model)
    if not found:
        return 0
    collectives = 0
    if world_size > 1:
        flat = torch.cat([m.pending_moments.reshape(-1) for m in found])
        dist.all_reduce(flat, group=group)
        collectives = 1
        for m, part in zip(found, flat.split([m.pending_moments.numel() for m in found])):
            m.pending_moments.copy_(part.view_as(m.pending_moments))
    for m in found:
        m.fold_pending()
    return collectives


def data_parallel_group():
    """fairseq's data-parallel group and its size (None, 1 without torch.distributed)."""
    from fairseq.distributed import utils as distributed_utils

    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = distributed_utils.get_data_parallel_group()
    return group, distributed_utils.get_world_size(group)


def loss_scale(optimizer) -> Optional[float]:
    """The scale of ``--amp``'s grad scaler (None otherwise): a step that lowers it was skipped for overflow."""
    scaler = getattr(optimizer, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else None

"""``--attention-cuda-graph``: an attention module's self-attention training step, forward and backward, captured in
CUDA graphs once per input shape and replayed (docs/design.md §1.5). The host then issues the step as two graph
launches, the copies into the graphs' inputs (x, its padding mask, the output's gradient) and those of the
parameters' gradients out of them, whatever the method's kernels, moment matcher and Python layers cost it to issue
eagerly (docs/benchmarks.md, *Host time*).

``torch.cuda.make_graphed_callables`` captures (``capture``). ``GraphedSteps`` decides at each step whether a graph
may stand in for the eager step, keys the graphs by what the step's host code reads (x's shape, dtype, device and
whether it needs a gradient, the mask's shape, the moment matcher's switches), and puts the module's buffers back
after a capture, whose warm-up passes would otherwise have folded ``WARMUP`` more batches into the matcher's running
statistics. A step runs eagerly, and says why once, where a graph cannot hold it (``eager_reason``) and where the
module's last graphed step still waits for its backward: the replay would overwrite the activations that backward
reads (a module run twice before its backward, as R-Drop does; fairseq's ``model.train()`` at each update, which a
failed attempt skips, forgets a backward that never came).
"""
import functools
import inspect
import logging
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .moment_matcher import _FLAGS, MomentMatcher

logger = logging.getLogger(__name__)
MAX_SHAPES = 4  # graphs a module keeps: each holds its step's saved activations in memory of its own
WARMUP = 3  # eager forward and backward passes before a capture (make_graphed_callables' default)
CAPTURE_MODE = "thread_local"  # only the capturing thread's unsafe CUDA calls break a capture
_SAID = set()  # the reasons logged (``GraphedSteps._say``): each once per process
_COPIED = weakref.WeakValueDictionary()  # id -> a parameter whose gradients ``_copied`` copies (a copy's are others)


def capture(step: nn.Module, args: Tuple[Tensor, ...]) -> Callable[..., Tensor]:
    """``step`` (a ``Step``) captured in a forward and a backward CUDA graph at ``args`` (x, [mask]), after
    ``WARMUP`` eager passes: a function of tensors like ``args`` that replays them
    (``torch.cuda.make_graphed_callables``; parameters unused by the step get no gradient)."""
    if args[0].device.type != "cuda":
        raise RuntimeError(f"--attention-cuda-graph needs CUDA: this attention module runs on {args[0].device.type} "
                           "(leave the option out on the CPU)")
    return graphed_callables(step, args)


def graphed_callables(step: nn.Module, args: Tuple[Tensor, ...]) -> Callable[..., Tensor]:
    """``torch.cuda.make_graphed_callables`` capturing in ``capture_error_mode="thread_local"``: a capture taken
    mid-epoch would otherwise be broken by the CUDA calls of another thread, as the pinned-memory allocations of
    fairseq's DataLoader (``pin_memory=True``). Passed where ``make_graphed_callables`` takes the mode, else given
    to the ``torch.cuda.graph`` it opens (torch <= 2.13 names none)."""
    make = torch.cuda.make_graphed_callables
    options = dict(num_warmup_iters=WARMUP, allow_unused_input=True)
    if "capture_error_mode" in inspect.signature(make).parameters:
        return make(step, args, capture_error_mode=CAPTURE_MODE, **options)
    opened = torch.cuda.graph
    torch.cuda.graph = functools.partial(opened, capture_error_mode=CAPTURE_MODE)
    try:
        return make(step, args, **options)
    finally:
        torch.cuda.graph = opened


def _copied(grad: Tensor) -> Tensor:
    """A parameter's gradient, copied: a replay returns the backward graph's static tensors, which autograd would
    make the parameters' ``.grad`` (pytorch/pytorch#181723) and the next replay overwrite, losing them under gradient
    accumulation (fairseq's ``--update-freq``) or a ``zero_grad`` that zeroes in place."""
    return grad.clone()


class Step(nn.Module):
    """An attention module's self-attention training forward, x (T, B, C) [and key_padding_mask (B, T)] -> (T, B, C),
    as a module whose parameters are the attention module's: what ``capture`` graphs. Kept out of the attention
    module's state (``GraphedSteps`` holds it)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        return self.attention.self_attention(x, key_padding_mask)


class GraphedSteps:
    """One attention module's captured training steps, at most ``MAX_SHAPES``, keyed by what the step's host code
    reads."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.matches_moments = any(isinstance(m, MomentMatcher) for m in module.modules())
        self.graphs: Dict[tuple, Callable[..., Tensor]] = {}
        self.pending_backward = False

    def __call__(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
        """The module's output (T, B, C) for x (T, B, C) and key_padding_mask (B, T) or None from its graph (captured
        at the key's first step), or None where this step runs eagerly (``eager_reason``)."""
        if not (self.module.training and torch.is_grad_enabled()):
            return None  # eval, activation checkpointing's first pass: nothing to capture, nothing to say
        why = self.eager_reason(x)
        mask_shape = None if key_padding_mask is None else (key_padding_mask.shape, key_padding_mask.dtype)
        key = (x.shape, x.dtype, x.device, x.requires_grad, mask_shape, _FLAGS.statistics_left_out,
               _FLAGS.folds_deferred)
        graphed = self.graphs.get(key) if why is None else None
        if graphed is None and why is None:
            if len(self.graphs) >= MAX_SHAPES:
                why = f"{MAX_SHAPES} input shapes captured already (a graph a shape, each with its activations' memory)"
            else:
                graphed = self.graphs[key] = self._captured(x, key_padding_mask)
        if why is not None:
            self._say(why)
            return None
        out = graphed(x) if key_padding_mask is None else graphed(x, key_padding_mask)
        if out.requires_grad:
            self.pending_backward = True
            out.register_hook(self._backward_started)
        return out

    def eager_reason(self, x: Tensor) -> Optional[str]:
        """Why this step on x cannot replay a graph (None if it can): what the host decides at each step that a
        replay would skip (a training forward with gradients)."""
        if self.pending_backward:
            return "a second forward before the backward of the first (its replay would overwrite the activations "\
                   "that backward reads)"
        if torch.is_autocast_enabled(x.device.type) and torch.is_autocast_cache_enabled():
            return "autocast with its weight cache (--amp), which CUDA graphs cannot capture: use --fp16 or --bf16"
        if (self.matches_moments and not _FLAGS.folds_deferred and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return "torch.distributed outside fairseq's trainer: the moment matcher all-reduces each training " \
                   "forward's statistics"
        return None

    def forget_pending(self) -> None:
        """A step's backward that will not come (fairseq's ``model.train()`` before each update attempt)."""
        self.pending_backward = False

    def _backward_started(self, grad: Tensor) -> None:
        self.pending_backward = False

    def _captured(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> Callable[..., Tensor]:
        """``capture`` at inputs like x and key_padding_mask, the module's buffers as they were before it."""
        buffers = [(b, b.clone()) for b in self.module.buffers()]
        args = (x.detach().clone().requires_grad_(x.requires_grad),)
        if key_padding_mask is not None:
            args += (key_padding_mask.clone(),)
        graphed = capture(Step(self.module), args)
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        for param in self.module.parameters():
            if param.requires_grad and _COPIED.get(id(param)) is not param:
                param.register_hook(_copied)
                _COPIED[id(param)] = param
        return graphed

    def _say(self, why: str) -> None:
        message = f"linattn: --attention-cuda-graph: {self.module.method} attention ran a step eagerly: {why}"
        if message not in _SAID:
            _SAID.add(message)
            logger.info(message)

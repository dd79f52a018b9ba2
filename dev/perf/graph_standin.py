"""A CPU stand-in for ``fairseq_linattn.modules.cuda_graph.capture`` (``torch.cuda.make_graphed_callables``): the
same warm-up passes, and the same autograd function around static tensors (the inputs copied in where they are
other tensors, the outputs and gradients returned as detached views of the static ones, overwritten by the next
replay), with each replay running the captured step eagerly into them, or nothing (``replays=False``: what a graphed
step leaves the host, ``dev.perf.host_time --cuda-graph``). What it cannot show is CUDA's own part, that the step
captures (no host sync, no CPU tensor, no allocation outside the graph's pool): the GPU self-test's ``cuda_graph``
stage runs that.

    monkeypatch.setattr(cuda_graph, "capture", graph_standin.capture)
"""
from typing import Callable, Tuple

import torch
from torch import Tensor, nn

from fairseq_linattn.modules.cuda_graph import WARMUP


def capture(step: nn.Module, args: Tuple[Tensor, ...], replays: bool = True) -> Callable[..., Tensor]:
    """``step`` graphed at ``args`` as ``make_graphed_callables`` graphs it (``WARMUP`` passes first, their input
    gradients asked of ``torch.autograd.grad``, parameters unused by the step given None)."""
    surface = tuple(args) + tuple(step.parameters())
    wanted = tuple(t for t in surface if t.requires_grad)
    for _ in range(WARMUP):
        out = step(*args)
        grads = torch.autograd.grad(out, wanted, torch.zeros_like(out), allow_unused=True)
    used = iter([g is not None for g in grads])
    static_out = step(*args).detach().clone()  # its shape and dtype (a capture runs no kernel: garbage until replayed)
    static_grad_out = torch.empty_like(static_out)
    static_grads = tuple(torch.empty_like(t) if t.requires_grad and next(used) else None for t in surface)
    last = {}

    def replay_forward() -> None:
        if replays:
            with torch.enable_grad():
                last["out"] = step(*args)
            static_out.copy_(last["out"].detach())

    def replay_backward() -> None:
        if replays:
            grads = iter(torch.autograd.grad(last.pop("out"), wanted, static_grad_out, allow_unused=True))
            for static, t in zip(static_grads, surface):
                grad = next(grads) if t.requires_grad else None
                if static is not None:
                    static.copy_(grad)

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs: Tensor) -> Tensor:
            for static, given in zip(args, inputs):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
            replay_forward()
            return static_out.detach()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad: Tensor) -> Tuple[Tensor, ...]:
            if static_grad_out.data_ptr() != grad.data_ptr():
                static_grad_out.copy_(grad)
            replay_backward()
            return tuple(None if g is None else g.detach() for g in static_grads)

    params = tuple(step.parameters())

    def graphed(*inputs: Tensor) -> Tensor:
        return Graphed.apply(*inputs, *params)
    return graphed

"""``torch.compile`` for an attention call whose batch size and lengths vary from call to call and whose head count
and head size do not (docs/design.md §1.4).

Only the varying dimensions are symbolic: the batch and length dimensions of (B, H, N, D) tensors and both dimensions
of (B, S) padding masks and (T, S) attention masks. With ``dynamic=True`` every dimension is a symbol, which on torch
2.13 made the compile of a causal LLN module step about 2x slower (the symbolic shape reasoning of each reshape) and
left Inductor to generate code for any head size.
"""
import functools
from typing import Callable

import torch
import torch._dynamo

VARYING_DIMS = {4: (0, 2), 2: (0, 1)}  # by a tensor's rank: (B, H, N, D) -> B and N; (B, S) or (T, S) -> both


def mark_varying_dims(*args) -> None:
    """Mark the batch and length dimensions of the tensors in ``args`` as dynamic for ``torch.compile`` (a hint:
    sizes 0 and 1 are still specialised, as with ``dynamic=True``); any 2-D tensor is taken for a mask, and other
    arguments are left alone."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            for dim in VARYING_DIMS.get(arg.dim(), ()):
                torch._dynamo.maybe_mark_dynamic(arg, dim)


def compile_varying_lengths(fn: Callable, **compile_kwargs) -> Callable:
    """``fn`` under ``torch.compile(**compile_kwargs)``, its tensor arguments marked by ``mark_varying_dims`` before
    each call: one graph serves every batch size and length (above 1), each head count and head size its own."""
    compiled = torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        mark_varying_dims(*args, *kwargs.values())
        return compiled(*args, **kwargs)

    return call

"""LAVO self-attention as an autograd op: q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D).

One autograd Function, ``_LAVO``, runs the implementation ``impl`` names (``IMPLEMENTATIONS``: ``looped.py``,
``parallel.py``, ``fused.py``, each with ``inputs``, ``forward`` and ``backward`` over ``LavoInputs``; the backwards are
hand-written).
"""
from typing import Optional

import torch
from torch import Tensor

from ..impls import declares, implementation_for
from ..precision import autocast_off, function_output
from ..real_tokens import over_reordered_tokens, real_first_order
from . import fused, looped, parallel
from .inputs import LAVO_TENSORS, LavoInputs, check_lavo

IMPLEMENTATIONS = {"looped": looped, "parallel": parallel, "fused": fused}


class _LAVO(torch.autograd.Function):
    """LAVO self-attention 0.5 (F_local + F_global) by the implementation ``impl``, from the fields of its
    ``LavoInputs``; saves their tensors and what its ``forward`` returned, and hands both to its ``backward``."""

    @staticmethod
    def forward(ctx, impl: str, *fields):
        x = LavoInputs(*fields)
        out, saved = IMPLEMENTATIONS[impl].forward(x)
        ctx.save_for_backward(*x[:LAVO_TENSORS], *saved)
        ctx.impl, ctx.causal = impl, x.causal
        return function_output(out, out.dtype)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        x = LavoInputs(*tensors[:LAVO_TENSORS], causal=ctx.causal)
        return (None, *IMPLEMENTATIONS[ctx.impl].backward(x, tensors[LAVO_TENSORS:], grad))


@autocast_off
def lavo_attention(q: Tensor, k: Tensor, v: Tensor, bases: Tensor, pos_bias: Tensor, *, window: int = 64,
                   causal: bool = True, key_padding_mask: Optional[Tensor] = None, impl: str = "auto",
                   real_first: bool = False) -> Tensor:
    """LAVO self-attention in O(N (w + r)) time and memory (no N×N matrix).

    q, k, v (B,H,N,D), bases (H,r,D), pos_bias (H,2w-1) -> (B,H,N,D). Causal local attention uses
    blocks of w queries against (previous + own) window with a band mask; the causal memory is an
    exclusive cumulative sum over windows of sum_t B x_t and of the token counts. ``impl`` (``impls.resolve_impl``):
    ``looped`` holds, beyond the inputs, the output, the gradients and working-size temporaries;
    ``parallel`` all windows at once, (B,H,N,K) temporaries, K = 2w causal, w otherwise; ``fused`` Triton kernels
    (half inputs and bases on CUDA, w <= 64: ``fused.not_supported_reasons``; other inputs are refused). Windows and
    relative positions count the tokens as given, padding included, unless ``real_first``: then they count each
    row's real tokens, padding anywhere (``real_tokens``, as the module runs it): an implementation that reads the
    rows through the real-first order (``READS_REAL_FIRST``: the fused kernels) reads and writes them there, the
    others run over q, k, v gathered in it and put the output back in fairseq's layout
    (``real_tokens.over_reordered_tokens``).
    """
    w, key_padding_mask = check_lavo(q, k, v, bases, pos_bias, window, key_padding_mask)
    impl = implementation_for(IMPLEMENTATIONS, impl, q, v, causal=causal, window=w, bases_dtype=bases.dtype)
    reordered = real_first_order(key_padding_mask) if real_first else None
    if reordered is None:
        return _lavo(q, k, v, key_padding_mask, bases, pos_bias, w, causal, impl)
    if declares(IMPLEMENTATIONS, impl, "READS_REAL_FIRST"):
        order, mask = reordered
        return _lavo(q, k, v, mask, bases, pos_bias, w, causal, impl, order)
    return over_reordered_tokens(_lavo, q, k, v, *reordered, bases, pos_bias, w, causal, impl)


def _lavo(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], bases: Tensor, pos_bias: Tensor,
          w: int, causal: bool, impl: str, order: Optional[Tensor] = None) -> Tensor:
    """``lavo_attention`` by ``impl`` (resolved; arguments checked), over the positions of ``order`` if given
    (``READS_REAL_FIRST``)."""
    extra = {} if order is None else {"order": order}
    x = IMPLEMENTATIONS[impl].inputs(q, k, v, bases, pos_bias, key_padding_mask, w, causal, **extra)
    return _LAVO.apply(impl, *x).to(q.dtype)

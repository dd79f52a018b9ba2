"""Skyformer as an autograd op: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv).

One autograd Function, ``_NystromApply``, runs the implementation ``impl`` names (``IMPLEMENTATIONS``: ``looped.py``,
``parallel.py``, ``fused.py``, each with ``inputs``, ``forward`` and ``backward`` over ``NystromInputs``).
"""
from typing import Optional

import torch
from torch import Tensor

from ..impls import implementation_for
from ..precision import autocast_off, function_output
from . import fused, looped, parallel
from .nystrom import GAMMA, NYSTROM_TENSORS, LandmarkChoice, NystromInputs, check_skyformer, landmark_rows

IMPLEMENTATIONS = {"looped": looped, "parallel": parallel, "fused": fused}


class _NystromApply(torch.autograd.Function):
    """out = C_Q (M^-T (C_K^T V)) (Skyformer eq. 6) by the implementation ``impl``, from the fields of its
    ``NystromInputs``; saves their tensors and what its ``forward`` returned, and hands both to its ``backward``."""

    @staticmethod
    def forward(ctx, impl: str, *fields):
        x = NystromInputs(*fields)
        out, saved = IMPLEMENTATIONS[impl].forward(x)
        ctx.save_for_backward(*x[:NYSTROM_TENSORS], *saved)
        ctx.impl, ctx.constants = impl, x[NYSTROM_TENSORS:]
        return function_output(out, out.dtype)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        x = NystromInputs(*tensors[:NYSTROM_TENSORS], *ctx.constants)
        return (None, *IMPLEMENTATIONS[ctx.impl].backward(x, tensors[NYSTROM_TENSORS:], grad))


@autocast_off
def skyformer_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 128,
                        key_padding_mask: Optional[Tensor] = None, mode: str = "stratified",
                        generator: Optional[torch.Generator] = None, exact_inverse: bool = False,
                        training: bool = True, causal: bool = False, gamma: float = GAMMA,
                        impl: str = "auto") -> Tensor:
    """out = C_Q ((C_K M^-1)^T V) (Skyformer eq. 6), never forming an N×N matrix.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). ``exact_inverse`` uses pinv(M) instead of the iteration.
    Half inputs compute in float32 (the iteration needs it) and return the input dtype. ``impl``
    (``impls.resolve_impl``): ``looped`` passes over rows of working size, ``parallel`` all 2N rows of [Q; K] at once,
    ``fused`` Triton kernels (half inputs on CUDA, at most 128 landmarks: ``fused.not_supported_reasons``; other
    inputs are refused).
    """
    choice = LandmarkChoice(num_landmarks, mode, generator, training)
    key_padding_mask = check_skyformer(q, k, v, key_padding_mask, choice, causal, gamma)
    impl = implementation_for(IMPLEMENTATIONS, impl, q, v, causal=causal, num_landmarks=num_landmarks)
    rows = landmark_rows(q, key_padding_mask, choice)
    # (C_K M^-1)^T V evaluated as M^-T (C_K^T V): O(N·d·Dv + d²·Dv) instead of O(N·d²)
    x = IMPLEMENTATIONS[impl].inputs(q, k, v, rows, key_padding_mask, gamma, exact_inverse)
    return _NystromApply.apply(impl, *x).to(q.dtype)

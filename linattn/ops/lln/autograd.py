"""LLN as an autograd op: q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv)."""
from typing import Optional

import torch
from torch import Tensor

from ..impls import declares, implementation_for, resolve_impl
from ..precision import autocast_off, function_output
from . import fused, looped, parallel
from .inputs import LLNInputs, lln_inputs

IMPLEMENTATIONS = {"looped": looped, "parallel": parallel, "fused": fused}


class _LLN(torch.autograd.Function):
    """LLN with a hand-written backward, in the implementation named first, over the fields of ``LLNInputs``
    (``looped`` receives q, k, v in the compute dtype, ``parallel`` in their own dtype). Saves the inputs and what
    the implementation's ``forward`` returned: its small state and, where its backward reads it, the output."""

    @staticmethod
    def forward(ctx, impl: str, *inputs):
        x = LLNInputs(*inputs)
        out, saved = IMPLEMENTATIONS[impl].forward(x)
        ctx.save_for_backward(x.q, x.k, x.v, x.alpha, x.beta, x.mask, *saved)
        ctx.impl, ctx.causal, ctx.chunk = impl, x.causal, x.chunk
        return function_output(out, x.q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, *saved = ctx.saved_tensors
        x = LLNInputs(q, k, v, alpha, beta, mask, ctx.causal, ctx.chunk)
        dq, dk, dv = IMPLEMENTATIONS[ctx.impl].backward(x, saved, grad)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


@autocast_off
def lln_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64, impl: str = "auto") -> Tensor:
    """LLN attention in O(N D Dv) time (non-causal) or chunked O(N C D + (N/C) D Dv) (causal).

    ``impl``: ``looped`` (passes of working size), ``parallel`` (every row or chunk at once, a fixed number of ops;
    its causal prefix over chunk states adds O((N/C)² D Dv)), ``fused`` (Triton kernels, half inputs on CUDA:
    ``fused.SUPPORT``; other inputs are refused, naming why: ``impls.ImplementationError``), ``auto``
    (``impls.choose``: looped on the CPU, parallel elsewhere).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv); alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1). Causal needs S == N. Half inputs compute in fp32.
    Known limit of the causal form: its shifts (one per query, one per key, none from a future
    token) make q·k products underflow in fp32 when a query's and a key's largest features, above
    about 35 each, sit on different channels (``test_causal_lln_misaligned_extreme_features...``).
    """
    resolved = resolve_impl(impl, q.device, available=IMPLEMENTATIONS)  # looped: upcast once, here
    x = lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal, chunk_size, upcast=resolved == "looped",
                   per_head=declares(IMPLEMENTATIONS, resolved, "PER_HEAD_SCALES"))
    impl = implementation_for(IMPLEMENTATIONS, impl, x.q, x.v, causal=causal, chunk=x.chunk)  # refused if it cannot
    return _LLN.apply(impl, *x).to(q.dtype)

"""LLN+Diag as autograd ops: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); ``average`` in one op."""
import functools
from typing import Optional

import torch
from torch import Tensor

from ..block_softmax.autograd import IMPLEMENTATIONS as BLOCK_IMPLEMENTATIONS
from ..block_softmax.autograd import block_softmax_in_order
from ..impls import BASE, declares, implementation_for
from ..inputs import check_positive_int
from ..lln.autograd import IMPLEMENTATIONS as LLN_IMPLEMENTATIONS
from ..lln.autograd import lln_attention
from ..lln.inputs import lln_inputs
from ..precision import autocast_off, function_output
from ..real_tokens import in_real_first_order
from . import fused
from .inputs import LLNDiagInputs, lln_diag_inputs
from .mixing import mix_lln_diag

# the parts' implementations of each name run (LLN's and the block softmax's tables); fused where both take the inputs
IMPLEMENTATIONS = {**dict.fromkeys(BASE), "fused": fused}


class _LLNDiagAverage(torch.autograd.Function):
    """0.5 (LLN + Diag) (LLN §4.2) in the implementation named first, over the fields of ``LLNDiagInputs``, with a
    hand-written backward: LLN's and the block softmax's implementations of that name, the block softmax averaged
    into LLN's output and its gradients added to LLN's (``looped``: in LLN's buffers). Saves the inputs and LLN's
    saved state (LLN's output only where its backward cannot rebuild it)."""

    @staticmethod
    def forward(ctx, impl: str, *inputs):
        x = LLNDiagInputs(*inputs)
        lln, saved = LLN_IMPLEMENTATIONS[impl].forward(x.lln, averaged=True)
        out, _ = BLOCK_IMPLEMENTATIONS[impl].forward(x.diag, average_with=lln)
        ctx.save_for_backward(x.q, x.k, x.v, x.alpha, x.beta, x.mask, x.block_mask, x.block_order, *saved)
        ctx.impl, ctx.options = impl, (x.causal, x.chunk, x.block)
        return function_output(out, x.q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, block_mask, block_order, *saved = ctx.saved_tensors
        x = LLNDiagInputs(q, k, v, alpha, beta, mask, block_mask, *ctx.options, block_order)
        grads = LLN_IMPLEMENTATIONS[ctx.impl].backward(x.lln, saved, grad, scale=0.5)
        dq, dk, dv = BLOCK_IMPLEMENTATIONS[ctx.impl].backward(x.diag, (), grad, scale=0.5, add_to=grads)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *(None,) * 8


@autocast_off
def lln_diag_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                       causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                       chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                       p: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); linear in N for a fixed block_size.

    ``average`` runs both parts in one op (``_LLNDiagAverage``: one output, one set of gradients);
    the learnable mixes, and learnt (gradient-requiring) alpha, beta, combine the two ops' outputs (the fused
    op folds learnt scales into q and k, which its block softmax must not see). With a key padding mask the op runs
    over each row's real-first order (``real_tokens``), so that its blocks count the row's real tokens, padding
    anywhere: q, k, v are gathered in that order and the output put back, except where non-causal with a block part
    that reads its rows through the order (``READS_REAL_FIRST``: the fused kernels; LLN's non-causal part does not
    depend on it), averaged or mixed. ``impl`` as LLN's; ``fused`` runs where both parts' kernels take the inputs
    (``fused.not_supported_reasons``), and is refused elsewhere.
    """
    learnt = any(isinstance(t, Tensor) and t.requires_grad for t in (alpha, beta))
    n = q.shape[2]
    block = min(check_positive_int("block_size", block_size), n)
    options = dict(alpha=alpha, beta=beta, block_size=block_size, causal=causal, chunk_size=chunk_size)
    if mix == "average" and not learnt:
        chunk = min(check_positive_int("chunk_size", chunk_size), n)
        impl = implementation_for(IMPLEMENTATIONS, impl, q, v, causal=causal, chunk=chunk, block=block)
        run = functools.partial(_average, impl=impl, **options)
        # non-causal LLN does not depend on the tokens' order: the blocks may read the rows through it
        in_place = not causal and declares(BLOCK_IMPLEMENTATIONS, impl, "READS_REAL_FIRST")
    else:
        block_impl = implementation_for(BLOCK_IMPLEMENTATIONS, impl, q, v, causal=causal, block=block)
        run = functools.partial(_mixed, impl=impl, block_impl=block_impl, mix=mix, r=r, p=p, **options)
        in_place = not causal and declares(BLOCK_IMPLEMENTATIONS, block_impl, "READS_REAL_FIRST")
    if in_place:
        return run(q, k, v, key_padding_mask)
    return in_real_first_order(run, q, k, v, key_padding_mask)


def _average(q, k, v, key_padding_mask, *, alpha, beta, block_size, causal, chunk_size, impl) -> Tensor:
    """The average (``_LLNDiagAverage``) in the resolved implementation ``impl``."""
    x = lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal, chunk_size, upcast=impl == "looped",
                   per_head=declares(IMPLEMENTATIONS, impl, "PER_HEAD_SCALES"))
    return _LLNDiagAverage.apply(impl, *lln_diag_inputs(x, block_size, BLOCK_IMPLEMENTATIONS[impl])).to(q.dtype)


def _mixed(q, k, v, key_padding_mask, *, alpha, beta, block_size, causal, chunk_size, impl, block_impl, mix, r,
           p) -> Tensor:
    """LLN's op and the block softmax's (in its resolved implementation ``block_impl``), mixed."""
    lln = lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                        chunk_size=chunk_size, impl=impl)
    diag = block_softmax_in_order(q, k, v, key_padding_mask, block_size, causal, block_impl)
    return mix_lln_diag(lln, diag, mix, r, p)

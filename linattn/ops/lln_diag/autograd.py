"""LLN+Diag as autograd ops: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); ``average`` in one op."""
from typing import Optional

import torch
from torch import Tensor

from ..block_softmax import parallel as block_parallel
from ..block_softmax.autograd import block_softmax_attention
from ..block_softmax.looped import block_valid, blocks_backward_, blocks_forward_
from ..impls import resolve_impl
from ..inputs import check_positive_int
from ..lln import parallel as lln_parallel
from ..lln.autograd import lln_attention, lln_inputs
from ..lln.looped import _causal_backward, _causal_forward, _noncausal_backward, _noncausal_forward
from ..precision import autocast_off
from .mixing import mix_lln_diag


class _LLNDiagAverage(torch.autograd.Function):
    """0.5 (LLN + Diag) (LLN §4.2) built in one output buffer, with a hand-written backward that adds
    both parts' gradients into one set of buffers. Inputs as ``lln.autograd._LLN`` plus valid (B|1,nb*bs) or None
    and the block size; saves only the inputs and LLN's small state (LLN's output is rebuilt)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mask, valid, causal: bool, c: int, bs: int):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        if causal:
            state, ctx.groups = _causal_forward(q, k, v, alpha, beta, mask, c, out)
        else:
            state = _noncausal_forward(q, k, v, alpha, beta, mask, out)
        blocks_forward_(q, k, v, valid, bs, causal, out, 0.5)
        ctx.save_for_backward(q, k, v, alpha, beta, mask, valid, *state)
        ctx.causal, ctx.c, ctx.bs = causal, c, bs
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, valid, *state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if ctx.causal:
            _causal_backward(q, k, v, alpha, beta, mask, state, ctx.groups, ctx.c, None, grad, 0.5, dq, dk, dv)
        else:
            _noncausal_backward(q, k, v, alpha, beta, mask, state, None, grad, 0.5, dq, dk, dv)
        blocks_backward_(q, k, v, valid, ctx.bs, ctx.causal, grad, 0.5, dq, dk, dv, accumulate=True)
        return dq, dk, dv, None, None, None, None, None, None, None


class _LLNDiagAverageParallel(torch.autograd.Function):
    """0.5 (LLN + Diag) (LLN §4.2), both parts in their parallel forms; q, k, v in their own dtype (saved as they
    are), hidden (B|1,1,nb,bs|1,bs) or None, other arguments as ``lln.autograd._LLNParallel``. Saves the inputs,
    LLN's small state and, if causal, LLN's output in the input dtype."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mask, hidden, causal: bool, c: int, bs: int):
        if causal:
            lln, state = lln_parallel.causal_forward(q, k, v, alpha, beta, mask, c)
        else:
            lln, state = lln_parallel.noncausal_forward(q, k, v, alpha, beta, mask)
        out = block_parallel.blocks_forward(q, k, v, hidden, bs, lln_out=lln).to(q.dtype)
        ctx.save_for_backward(q, k, v, alpha, beta, mask, hidden, lln.to(q.dtype) if causal else None, *state)
        ctx.causal, ctx.c, ctx.bs = causal, c, bs
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, hidden, lln, *state = ctx.saved_tensors
        if ctx.causal:
            grads = lln_parallel.causal_backward(q, k, v, alpha, beta, mask, state, ctx.c, lln, grad, 0.5)
        else:
            grads = lln_parallel.noncausal_backward(q, k, v, alpha, beta, mask, state, grad, 0.5)
        diag = block_parallel.blocks_backward(q, k, v, hidden, ctx.bs, grad, 0.5)
        return (*(a.add_(b).to(x.dtype) for a, b, x in zip(grads, diag, (q, k, v))),
                None, None, None, None, None, None, None)


def lln_diag_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                       causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                       chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                       p: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); linear in N for a fixed block_size.

    ``average`` runs both parts in one op (``_LLNDiagAverage``: one output, one set of gradients);
    the learnable mixes, and learnt (gradient-requiring) alpha, beta, combine the two ops' outputs (the fused
    op folds learnt scales into q and k, which its block softmax must not see).
    """
    learnt = any(isinstance(t, Tensor) and t.requires_grad for t in (alpha, beta))
    if mix == "average" and not learnt:
        return _lln_diag_average(q, k, v, alpha, beta, block_size, causal, key_padding_mask, chunk_size, impl)
    lln = lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                        chunk_size=chunk_size, impl=impl)
    diag = block_softmax_attention(q, k, v, block_size=block_size, causal=causal,
                                   key_padding_mask=key_padding_mask, impl=impl)
    return mix_lln_diag(lln, diag, mix, r, p)


@autocast_off
def _lln_diag_average(q, k, v, alpha, beta, block_size, causal, key_padding_mask, chunk_size, impl) -> Tensor:
    parallel = resolve_impl(impl, q.device) == "parallel"
    chunk_size = check_positive_int("chunk_size", chunk_size)
    block_size = check_positive_int("block_size", block_size)
    args = lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal, upcast=not parallel)
    n = q.shape[2]
    bs = min(block_size, n)
    valid = block_valid(args[-1], n, bs, q.device)
    if parallel:
        hidden = block_parallel.hidden_keys(valid, bs, causal, q.device)
        return _LLNDiagAverageParallel.apply(*args, hidden, causal, min(chunk_size, n), bs)
    return _LLNDiagAverage.apply(*args, valid, causal, min(chunk_size, n), bs).to(q.dtype)

"""LLN as an autograd op: q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv)."""
from typing import Optional

import torch
from torch import Tensor

from ..impls import resolve_impl
from ..inputs import check_key_padding_mask, check_positive_int, check_positive_scale, check_qkv
from ..precision import autocast_off, compute_dtype
from . import parallel
from .looped import _causal_backward, _causal_forward, _noncausal_backward, _noncausal_forward


class _LLN(torch.autograd.Function):
    """LLN with a hand-written backward; q, k, v (B,H,N,·) in the compute dtype, alpha, beta
    (B|1,H|1,1,1) constants, mask (B,S) or None. Saves only the inputs and the small state of
    ``_noncausal_forward`` / ``_causal_forward`` and the output (the caller holds it anyway)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mask, causal: bool, c: int):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        if causal:
            state, ctx.groups = _causal_forward(q, k, v, alpha, beta, mask, c, out)
        else:
            state = _noncausal_forward(q, k, v, alpha, beta, mask, out)
        ctx.save_for_backward(q, k, v, alpha, beta, mask, out, *state)
        ctx.causal, ctx.c = causal, c
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, out, *state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if ctx.causal:
            _causal_backward(q, k, v, alpha, beta, mask, state, ctx.groups, ctx.c, out, grad, 1, dq, dk, dv)
        else:
            _noncausal_backward(q, k, v, alpha, beta, mask, state, out, grad, 1, dq, dk, dv)
        return dq, dk, dv, None, None, None, None, None


class _LLNParallel(torch.autograd.Function):
    """LLN's parallel form (``parallel``) with a hand-written backward; q, k, v (B,H,N,·) in their own dtype (half
    inputs are saved as they are and upcast in the forward and again in the backward), other arguments as
    ``_LLN``. Saves the inputs and the small state: shifts (B,H,N/c,D) and denominators (B,H,N,1)."""

    @staticmethod
    def forward(ctx, q, k, v, alpha, beta, mask, causal: bool, c: int):
        if causal:
            out, state = parallel.causal_forward(q, k, v, alpha, beta, mask, c)
        else:
            out, state = parallel.noncausal_forward(q, k, v, alpha, beta, mask)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, alpha, beta, mask, out if causal else None, *state)
        ctx.causal, ctx.c = causal, c
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, alpha, beta, mask, out, *state = ctx.saved_tensors
        if ctx.causal:
            dq, dk, dv = parallel.causal_backward(q, k, v, alpha, beta, mask, state, ctx.c, out, grad)
        else:
            dq, dk, dv = parallel.noncausal_backward(q, k, v, alpha, beta, mask, state, grad)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal: bool, upcast: bool = True):
    """Validated (q, k, v, alpha, beta, mask) for the fast paths: tensors in the compute dtype (``upcast``; else
    in their own dtype), alpha and beta (B|1,H|1,1,1) constants (learnt scales are folded into q and k, where
    autograd carries them; q and k are then in the compute dtype)."""
    check_qkv(q, k, v, same_length=causal)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    ct = compute_dtype(q)
    alpha = check_positive_scale("alpha", alpha, q).to(ct)
    beta = check_positive_scale("beta", beta, q).to(ct)
    if alpha.requires_grad or beta.requires_grad:
        q, k, alpha, beta = alpha * q.to(ct), beta * k.to(ct), torch.ones_like(alpha), torch.ones_like(beta)
    if upcast:
        q, k, v = q.to(ct), k.to(ct), v.to(ct)
    return q, k, v, alpha.detach(), beta.detach(), key_padding_mask


@autocast_off
def lln_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                  key_padding_mask: Optional[Tensor] = None, chunk_size: int = 64, impl: str = "auto") -> Tensor:
    """LLN attention in O(N D Dv) time (non-causal) or chunked O(N C D + (N/C) D Dv) (causal).

    ``impl``: ``looped`` (passes of working size), ``parallel`` (every row or chunk at once, a fixed number of ops;
    its causal prefix over chunk states adds O((N/C)² D Dv)), ``auto`` (``forms.resolve_impl``).

    q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv); alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1). Causal needs S == N. Half inputs compute in fp32.
    Known limit of the causal form: its shifts (one per query, one per key, none from a future
    token) make q·k products underflow in fp32 when a query's and a key's largest features, above
    about 35 each, sit on different channels (``test_causal_lln_misaligned_extreme_features...``).
    """
    chunk_size = check_positive_int("chunk_size", chunk_size)
    parallel_form = resolve_impl(impl, q.device) == "parallel"
    args = lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal, upcast=not parallel_form)
    return (_LLNParallel if parallel_form else _LLN).apply(*args, causal, min(chunk_size, q.shape[2])).to(q.dtype)

"""Block softmax as an autograd op: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv)."""
from typing import Optional

import torch
from torch import Tensor

from ..impls import resolve_impl
from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..precision import autocast_off, compute_dtype
from . import parallel
from .looped import block_valid, blocks_backward_, blocks_forward_


class _BlockSoftmax(torch.autograd.Function):
    """Block-diagonal softmax with a hand-written backward that recomputes the probabilities per group
    of blocks; q, k, v (B,H,N,·) compute dtype, valid (B,nb*bs) or None. Saves only the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, valid, bs: int, causal: bool):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        blocks_forward_(q, k, v, valid, bs, causal, out, 1.0)
        ctx.save_for_backward(q, k, v, valid)
        ctx.bs, ctx.causal = bs, causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, valid = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        blocks_backward_(q, k, v, valid, ctx.bs, ctx.causal, grad, 1.0, dq, dk, dv, accumulate=False)
        return dq, dk, dv, None, None, None


class _BlockSoftmaxParallel(torch.autograd.Function):
    """Block-diagonal softmax, every block at once (``parallel``); q, k, v (B,H,N,·) in their own dtype (saved as
    they are), hidden (B|1,1,nb,bs|1,bs) or None. The backward recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, hidden, bs: int):
        ctx.save_for_backward(q, k, v, hidden)
        ctx.bs = bs
        return parallel.blocks_forward(q, k, v, hidden, bs).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, hidden = ctx.saved_tensors
        dq, dk, dv = parallel.blocks_backward(q, k, v, hidden, ctx.bs, grad)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


@autocast_off
def block_softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """Tokens [m*bs, (m+1)*bs) attend to keys of their own block only; a shorter last block.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). Padded keys are masked inside blocks; causal adds
    a lower-triangular mask in each block. Queries with no allowed key get 0. O(N * bs) time; beyond
    the inputs it holds the output, the gradients and working-size temporaries (``_BlockSoftmax``, ``looped``),
    or every block's (bs, bs) probabilities at once (``_BlockSoftmaxParallel``, ``parallel``).
    """
    check_qkv(q, k, v)
    impl = resolve_impl(impl, q.device)
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n = q.shape[2]
    bs = min(block_size, n)
    ct = compute_dtype(q)
    valid = block_valid(key_padding_mask, n, bs, q.device)
    if impl == "parallel":
        return _BlockSoftmaxParallel.apply(q, k, v, parallel.hidden_keys(valid, bs, causal, q.device), bs)
    return _BlockSoftmax.apply(q.to(ct), k.to(ct), v.to(ct), valid, bs, causal).to(q.dtype)

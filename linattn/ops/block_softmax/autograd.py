"""Block softmax as an autograd op: q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv)."""
from typing import Optional

import torch
from torch import Tensor

from ..impls import declares, implementation_for
from ..inputs import check_positive_int, check_qkv
from ..precision import autocast_off, function_output
from ..real_tokens import in_real_first_order
from . import fused, looped, parallel
from .inputs import BlockInputs, block_inputs

IMPLEMENTATIONS = {"looped": looped, "parallel": parallel, "fused": fused}


class _BlockSoftmax(torch.autograd.Function):
    """Block-diagonal softmax with a hand-written backward that recomputes the probabilities, in the implementation
    named first, over the fields of ``BlockInputs`` (``looped`` receives q, k, v in the compute dtype, ``parallel``
    and ``fused`` in their own dtype). Saves only the inputs."""

    @staticmethod
    def forward(ctx, impl: str, *inputs):
        x = BlockInputs(*inputs)
        out, saved = IMPLEMENTATIONS[impl].forward(x)
        ctx.save_for_backward(x.q, x.k, x.v, x.mask, x.order, *saved)
        ctx.impl, ctx.causal, ctx.block = impl, x.causal, x.block
        return function_output(out, x.q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, order, *saved = ctx.saved_tensors
        x = BlockInputs(q, k, v, mask, ctx.causal, ctx.block, order)
        dq, dk, dv = IMPLEMENTATIONS[ctx.impl].backward(x, saved, grad)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@autocast_off
def block_softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, block_size: int = 64, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """Tokens [m*bs, (m+1)*bs) attend to keys of their own block only; a shorter last block.

    q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv). With a key padding mask the blocks count each row's real tokens,
    padding anywhere (``real_tokens``: blocks of its real-first order), and padded keys are masked; causal adds
    a lower-triangular mask in each block. Queries with no allowed key get 0. O(N * bs) time; beyond
    the inputs it holds the output, the gradients and working-size temporaries (``looped``), or every block's
    (bs, bs) probabilities at once (``parallel``); ``fused``: Triton kernels, half inputs (``fused.SUPPORT``; other
    inputs are refused, ``impls.implementation_for``).
    """
    check_qkv(q, k, v)
    block = min(check_positive_int("block_size", block_size), q.shape[2])
    impl = implementation_for(IMPLEMENTATIONS, impl, q, v, causal=causal, block=block)  # refused if it cannot
    if declares(IMPLEMENTATIONS, impl, "READS_REAL_FIRST"):  # its kernels read the rows through the order
        return block_softmax_in_order(q, k, v, key_padding_mask, block_size, causal, impl)
    return in_real_first_order(block_softmax_in_order, q, k, v, key_padding_mask, block_size, causal, impl)


def block_softmax_in_order(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], block_size: int,
                           causal: bool, impl: str) -> Tensor:
    """``block_softmax_attention`` in the implementation ``impl`` (resolved, q, k, v checked), for a key padding
    mask whose real tokens come first in each row (``real_first_order``'s), or any mask if ``impl`` reads the rows
    through that order itself (``READS_REAL_FIRST``)."""
    x = block_inputs(q, k, v, key_padding_mask, block_size, causal, IMPLEMENTATIONS[impl])
    return _BlockSoftmax.apply(impl, *x).to(q.dtype)

"""LLN+Diag (LLN §4.2, Fig. 3): LLN over the whole sequence mixed with block-diagonal softmax."""
from typing import Optional

import torch
from torch import Tensor

from ._checks import Rows, autocast_off, check_positive_int
from .block_softmax import (block_softmax_attention, block_softmax_attention_reference, block_softmax_weights,
                            block_valid, blocks_backward_, blocks_forward_)
from .lln import (_causal_backward, _causal_forward, _noncausal_backward, _noncausal_forward, lln_attention,
                  lln_attention_reference, lln_attention_weights, lln_inputs)

MIX_MODES = ("average", "learnable_scale", "learnable_ratio")


def mix_lln_diag(lln_out: Tensor, diag_out: Tensor, mix: str = "average", r: Optional[Tensor] = None,
                 p: Optional[Tensor] = None) -> Tensor:
    """average: (LLN + Diag)/2; learnable_scale: r*LLN + p*Diag; learnable_ratio: r*LLN + (1-r)*Diag.

    r, p are (H, Dv) (per head and channel), broadcast over batch and tokens.
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    if mix == "average":
        return 0.5 * (lln_out + diag_out)
    h, dv = lln_out.shape[1], lln_out.shape[-1]
    needed = {"learnable_scale": ("r", "p"), "learnable_ratio": ("r",)}[mix]
    for name, t in (("r", r), ("p", p)):
        if name in needed and (t is None or tuple(t.shape) != (h, dv)):
            raise ValueError(f"mix={mix!r} needs {name} of shape (H, Dv) = {(h, dv)}, "
                             f"got {None if t is None else tuple(t.shape)}")
    r4 = r[None, :, None, :].to(lln_out.dtype)
    if mix == "learnable_scale":
        return r4 * lln_out + p[None, :, None, :].to(lln_out.dtype) * diag_out
    return r4 * lln_out + (1 - r4) * diag_out


class _LLNDiagAverage(torch.autograd.Function):
    """0.5 (LLN + Diag) (LLN §4.2) built in one output buffer, with a hand-written backward that adds
    both parts' gradients into one set of buffers. Inputs as ``lln._LLN`` plus valid (B|1,nb*bs) or None
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


def lln_diag_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                       causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                       chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                       p: Optional[Tensor] = None) -> Tensor:
    """q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); linear in N for a fixed block_size.

    ``average`` runs both parts in one op (``_LLNDiagAverage``: one output, one set of gradients);
    the learnable mixes combine the two ops' outputs.
    """
    if mix == "average":
        return _lln_diag_average(q, k, v, alpha, beta, block_size, causal, key_padding_mask, chunk_size)
    lln = lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                        chunk_size=chunk_size)
    diag = block_softmax_attention(q, k, v, block_size=block_size, causal=causal,
                                   key_padding_mask=key_padding_mask)
    return mix_lln_diag(lln, diag, mix, r, p)


@autocast_off
def _lln_diag_average(q, k, v, alpha, beta, block_size, causal, key_padding_mask, chunk_size) -> Tensor:
    chunk_size = check_positive_int("chunk_size", chunk_size)
    block_size = check_positive_int("block_size", block_size)
    args = lln_inputs(q, k, v, alpha, beta, key_padding_mask, causal)
    n = q.shape[2]
    bs = min(block_size, n)
    valid = block_valid(args[-1], n, bs, q.device)
    return _LLNDiagAverage.apply(*args, valid, causal, min(chunk_size, n), bs).to(q.dtype)


def lln_diag_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                                 causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                                 chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                                 p: Optional[Tensor] = None) -> Tensor:
    """Both parts materialised as N×N matrices."""
    lln = lln_attention_reference(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                                  chunk_size=chunk_size)
    diag = block_softmax_attention_reference(q, k, v, block_size=block_size, causal=causal,
                                             key_padding_mask=key_padding_mask)
    return mix_lln_diag(lln, diag, mix, r, p)


def lln_diag_attention_weights(q: Tensor, k: Tensor, alpha, beta, *, block_size: int = 64, causal: bool = False,
                               key_padding_mask: Optional[Tensor] = None, mix: str = "average",
                               r: Optional[Tensor] = None, p: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the row-stochastic LLN+Diag matrix (LLN §4.2): q, k (B,H,N,D) -> (B,H,R,N), compute dtype.

    ``average``: 0.5 P_lln + 0.5 P_diag, exact (P V is the output). The learnable mixes weigh each value
    channel c separately (r, p of shape (H, Dv)), so P uses each head's mean weights r̄, p̄:
    ``learnable_ratio`` r̄ P_lln + (1 - r̄) P_diag, ``learnable_scale`` (r̄ P_lln + p̄ P_diag) / (r̄ + p̄);
    exact when the weights are constant over a head's channels (for ``learnable_scale`` the output is
    then (r̄ + p̄) P V).
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    lln = lln_attention_weights(q, k, alpha, beta, causal=causal, key_padding_mask=key_padding_mask, rows=rows)
    diag = block_softmax_weights(q, k, block_size=block_size, causal=causal, key_padding_mask=key_padding_mask,
                                 rows=rows)
    if mix == "average":
        return 0.5 * lln + 0.5 * diag
    for name, t in (("r", r), ("p", p if mix == "learnable_scale" else r)):
        if t is None or t.dim() != 2 or t.shape[0] != q.shape[1]:
            raise ValueError(f"mix={mix!r} needs {name} of shape (H, Dv) with H = {q.shape[1]}, "
                             f"got {None if t is None else tuple(t.shape)}")
    r_mean = r.to(lln.dtype).mean(-1)[None, :, None, None]
    if mix == "learnable_ratio":
        return r_mean * lln + (1 - r_mean) * diag
    p_mean = p.to(lln.dtype).mean(-1)[None, :, None, None]
    if not bool(((r_mean >= 0) & (p_mean >= 0) & (r_mean + p_mean > 0)).all()):
        raise ValueError("lln_diag mix 'learnable_scale' with negative mean weights r, p has no "
                         "row-stochastic attention matrix")
    return (r_mean * lln + p_mean * diag) / (r_mean + p_mean)

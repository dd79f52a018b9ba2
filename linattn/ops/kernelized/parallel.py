"""Kernelized attention's parallel implementation: C V through one ``scaled_dot_product_attention`` call on augmented
inputs.

With q_s, k_s = q, k scaled by D^(-1/4) (so q_s·k_s = q·k / sqrt(D), SDPA's scale), SDPA attends with the scores
q_s·k_s - |k_s|²/2 over the keys and |q_s|²/2 over one extra "sink" key whose value is a one-hot extra column.
Shifting row i's scores by -|q_s|²/2 changes no softmax: the weights are C_ij / (1 + sum_j C_ij) for the keys
(Skyformer §4.1, C_ij = exp(-|q_s,i - k_s,j|²/2) <= 1) and 1 / (1 + sum_j C_ij) >= 1 / (S + 1) for the sink, which
never underflows; the value columns over the extra column are then sum_j C_ij v_j exactly. Memory and saved tensors
are SDPA's (no S×N matrix), gradients SDPA's own backward; padded keys are masked (never the sink).
Precision: the scores are formed inside SDPA as q·k - |k|²/2 and shifted by the sink's |q|²/2, so C_ij carries an
absolute exponent error of about eps·(|q_s|² + |k_s|²)/2 (as the looped implementation's exp(q·k - |q|²/2 - |k|²/2));
half inputs stay half (SDPA accumulates in float32) with each norm split in three half columns (hi + mid + lo), and
their outputs, rounded to half by SDPA, carry about twice the rounding of the looped implementation's (bf16: a
relative error of 3.5e-3 against 1.6e-3).
"""
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import compute_dtype
from .kernel import KernelizedInputs

SINK_VALUE = 256.0  # the sink's value in the extra column: 256 / (1 + sum C) stays a normal fp16 number to S ~ 2^22


def _half_norm(x: Tensor) -> List[Tensor]:
    """|x|²/2 (B,H,R,1) as columns in x's dtype summing to it: one for float32/64; for half three (hi, mid, lo:
    float32's 24 bits in bf16), since one half column would put an error of |x|²/2 · 2^-9 in the exponent."""
    norm = 0.5 * x.to(compute_dtype(x)).square().sum(-1, keepdim=True)
    if norm.dtype == x.dtype:
        return [norm]
    parts = []
    for _ in range(3):
        parts.append(norm.to(x.dtype))
        norm = norm - parts[-1].to(norm.dtype)
    return parts


def _width(cols: int) -> int:
    """``cols`` padded to a multiple of 8 (SDPA's fused kernels want aligned head dims)."""
    return -(-cols // 8) * 8


def _one_hot(like: Tensor, width: int, start: int, stop: int, value: float) -> Tensor:
    """(width,) zeros in like's dtype and device, ``value`` in [start, stop)."""
    row = torch.zeros(width, dtype=like.dtype, device=like.device)
    row[start:stop] = value
    return row


class _Augment(torch.autograd.Function):
    """x (B,H,R,D) -> x'' (B,H,R(+1),W): queries [x, 1.., n_1, .., n_p, 0..], keys [x, -n_1, .., -n_p, 0.., 0..]
    with n_1 + .. + n_p = |x|²/2 (``_half_norm``), and for keys the sink row [0, 0.., 1.., 0..] appended. The norm
    columns' gradient (one of them: they meet the same ones), times ±x, joins x's. Saves x'' only, which SDPA saves
    too (one storage)."""

    @staticmethod
    def forward(ctx, x, key: bool):
        b, h, rows, dim = x.shape
        parts = _half_norm(x)
        p, width = len(parts), _width(dim + 2 * len(parts))
        cols = [x, *[-t for t in parts], x.new_zeros(b, h, rows, p)] if key else [x, x.new_ones(b, h, rows, p), *parts]
        xa = F.pad(torch.cat(cols, dim=-1), (0, width - dim - 2 * p))
        if key:
            xa = torch.cat([xa, _one_hot(x, width, dim + p, dim + 2 * p, 1.0).expand(b, h, 1, width)], dim=2)
        ctx.save_for_backward(xa)
        ctx.shape, ctx.key, ctx.parts = x.shape, key, p
        return xa

    @staticmethod
    def backward(ctx, grad):
        (xa,), (_, _, rows, dim), p = ctx.saved_tensors, ctx.shape, ctx.parts
        ct = compute_dtype(xa)
        start = dim if ctx.key else dim + p
        gn = grad[:, :, :rows, start:start + 1].to(ct)  # the p norm columns meet the same ones: equal gradients
        dx = torch.addcmul(grad[:, :, :rows, :dim].to(ct), gn, xa[:, :, :rows, :dim].to(ct), value=-1 if ctx.key else 1)
        return dx.to(xa.dtype), None


def forward(x: KernelizedInputs) -> Tensor:
    """out_i = sum_j C_ij v_j (Skyformer §4.1): q (B,H,N,D), k (B,H,S,D), v (B,H,S,Dv) -> (B,H,N,Dv) in q's dtype
    (chunk_size unused)."""
    q, k, v, key_padding_mask = x.q, x.k, x.v, x.pad
    b, h, _, dim = q.shape
    dv = v.shape[-1]
    mask = None
    if key_padding_mask is not None:  # whatever padded keys hold (even inf) must not reach a score
        pad = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        mask = torch.cat([~key_padding_mask, key_padding_mask.new_ones(b, 1)], dim=1)[:, None, None, :]
    # q''·k'' = q·k - |k|²/2 and q''·k* = |q|²/2, times SDPA's scale 1/sqrt(D): the scores on q_s, k_s
    qa, ka = _Augment.apply(q, False), _Augment.apply(k, True)
    vwidth = _width(dv + 1)  # v'' = [v, 0], the sink's value [0, SINK_VALUE]
    vsink = _one_hot(q, vwidth, dv, dv + 1, SINK_VALUE).expand(b, h, 1, vwidth)
    va = torch.cat([F.pad(v, (0, vwidth - dv)), vsink], dim=2)
    o = F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=dim ** -0.5)
    # sum_j C v / (1 + sum C) over SINK_VALUE / (1 + sum C), in the compute dtype
    return (o[..., :dv] * (SINK_VALUE / o[..., dv:dv + 1].to(compute_dtype(q)))).to(q.dtype)

"""LLN's moment matching after the token sums, in one launch of one program (LLN §4.1, docs/design.md §3.1):
``linattn::lln_scales`` (variances -> sigma, alpha, beta, tau) and, a training forward, ``linattn::lln_scales_recorded``
(the same, and the batch's moments folded into the running statistics, or added to the pending ones, in the same
program). The same float64 arithmetic as ``ops/moment_matching.py`` and the moment matcher's ``_variances``,
``_match`` and ``_fold``, whose two dozen launches of (2, G) tensors each a training forward ran. Modes ``paper``
and ``fit`` (a line a x + b); ``exact`` and ``off`` stay with the matcher's own code.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..moment_matching import _MIN_S2, MIN_SIGMA
from .common import launch, next_power_of_2
from .kernel_op import kernel_op

MIN_SIGMA, MIN_S2 = tl.constexpr(MIN_SIGMA), tl.constexpr(_MIN_S2)  # read by the kernels


@triton.jit
def _clamp_min(x, lo):
    """max(x, lo), NaN kept (as torch's ``clamp_min``: a NaN alpha must reach the scale checks)."""
    return tl.where(x < lo, lo, x)


@triton.jit
def _clamp_max(x, hi):
    """min(x, hi), NaN kept."""
    return tl.where(x > hi, hi, x)


@triton.jit
def _f64(x: tl.constexpr):
    """The float64 constant x (a Python float argument or literal would be rounded to float32)."""
    return tl.full([], x, tl.float64)


@triton.jit
def _variances(moments_ptr, g, ok, G):
    """var q, var k, count (float64) of groups g from moments (5, G): sum q, sum k, sum q², sum k², entries; variance 1
    where there is no entry."""
    count = tl.load(moments_ptr + 4 * G + g, mask=ok, other=0.0)
    n = _clamp_min(count, 1.0)
    mq = tl.load(moments_ptr + g, mask=ok, other=0.0) / n
    mk = tl.load(moments_ptr + G + g, mask=ok, other=0.0) / n
    vq = _clamp_min(tl.load(moments_ptr + 2 * G + g, mask=ok, other=0.0) / n - mq * mq, 0.0)
    vk = _clamp_min(tl.load(moments_ptr + 3 * G + g, mask=ok, other=0.0) / n - mk * mk, 0.0)
    empty = count <= 0
    return tl.where(empty, 1.0, vq), tl.where(empty, 1.0, vk), count


@triton.jit
def _scale_groups(first_ptr, second_ptr, stats_ptr, ab_ptr, g, ok, G, A: tl.constexpr, B: tl.constexpr,
                  MAX_SCALE: tl.constexpr, MOMENTS: tl.constexpr):
    """stats (5, G) float64: sigma q, sigma k, alpha, beta, tau; ab (2, G) in its dtype: alpha, beta, of groups g.
    The variances are those of moments (5, G) at ``first_ptr`` (MOMENTS) or the buffers var q, var k (G,) at
    ``first_ptr``, ``second_ptr``."""
    if MOMENTS:
        vq, vk, _ = _variances(first_ptr, g, ok, G)
    else:
        vq = tl.load(first_ptr + g, mask=ok, other=1.0).to(tl.float64)
        vk = tl.load(second_ptr + g, mask=ok, other=1.0).to(tl.float64)
    a, b, max_scale = _f64(A), _f64(B), _f64(MAX_SCALE)
    sq = _clamp_min(tl.sqrt(vq), _f64(MIN_SIGMA))
    sk = _clamp_min(tl.sqrt(vk), _f64(MIN_SIGMA))
    s = tl.sqrt(_clamp_min(((sq * sq) * (sk * sk) - b) / _f64(2 * A), _f64(MIN_S2)))  # Prop. 4.1 with eq. 10
    alpha = _clamp_max(s / sq, max_scale)
    beta = _clamp_max(s / sk, max_scale)
    var_lln = a * ((alpha * alpha) * (sq * sq) + (beta * beta) * (sk * sk)) + b  # eq. 11
    tau = 1.0 / tl.sqrt(_clamp_min(var_lln, _f64(1e-12)))
    tl.store(stats_ptr + g, sq, mask=ok)
    tl.store(stats_ptr + G + g, sk, mask=ok)
    tl.store(stats_ptr + 2 * G + g, alpha, mask=ok)
    tl.store(stats_ptr + 3 * G + g, beta, mask=ok)
    tl.store(stats_ptr + 4 * G + g, tau, mask=ok)
    tl.store(ab_ptr + g, alpha.to(ab_ptr.dtype.element_ty), mask=ok)
    tl.store(ab_ptr + G + g, beta.to(ab_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fold_groups(moments_ptr, bq_ptr, bk_ptr, batches_ptr, g, ok, G, MOMENTUM: tl.constexpr, BATCH: tl.constexpr):
    """buf <- m buf + (1 - m) var for the groups g whose variances are finite and that have entries (bq_ptr, bk_ptr:
    the float32 buffers (G,)); BATCH: m = min(1 - 1 / (n + 1), momentum) with n the batches folded (int64 at
    ``batches_ptr``), counted on when every group folded."""
    vq, vk, count = _variances(moments_ptr, g, ok, G)
    finite = (vq < float("inf")) & (vk < float("inf")) & (count > 0)
    m = _f64(MOMENTUM)
    if BATCH:
        folded = tl.load(batches_ptr)
        m = _clamp_max(1.0 - 1.0 / (folded.to(tl.float64) + 1.0), m)
        tl.store(batches_ptr, folded + tl.min(tl.where(finite | ~ok, 1, 0), 0).to(tl.int64))
    old_q = tl.load(bq_ptr + g, mask=ok).to(tl.float64)
    old_k = tl.load(bk_ptr + g, mask=ok).to(tl.float64)
    tl.store(bq_ptr + g, tl.where(finite, m * old_q + (1 - m) * vq, old_q).to(bq_ptr.dtype.element_ty), mask=ok)
    tl.store(bk_ptr + g, tl.where(finite, m * old_k + (1 - m) * vk, old_k).to(bk_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _scales(first_ptr, second_ptr, stats_ptr, ab_ptr, moments_ptr, bq_ptr, bk_ptr, batches_ptr, pending_ptr, G,
            A: tl.constexpr, B: tl.constexpr, MAX_SCALE: tl.constexpr, MOMENTS: tl.constexpr, FOLD: tl.constexpr,
            PENDING: tl.constexpr, MOMENTUM: tl.constexpr, BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """``_scale_groups`` of every group, then (FOLD) the moments (5, G) at ``moments_ptr`` folded into the buffers
    (``_fold_groups``), or (PENDING) added to the pending moments (5, G) float64 at ``pending_ptr``. The scales read
    the buffers before the fold writes them: the same lanes load and store each group."""
    g = tl.arange(0, BLOCK)
    ok = g < G
    _scale_groups(first_ptr, second_ptr, stats_ptr, ab_ptr, g, ok, G, A, B, MAX_SCALE, MOMENTS)
    if FOLD:
        _fold_groups(moments_ptr, bq_ptr, bk_ptr, batches_ptr, g, ok, G, MOMENTUM, BATCH)
    if PENDING:
        for i in tl.static_range(5):
            at = pending_ptr + i * G + g
            tl.store(at, tl.load(at, mask=ok) + tl.load(moments_ptr + i * G + g, mask=ok), mask=ok)


@kernel_op("lln_scales")
def lln_scales(first: Tensor, second: Tensor, a: float, b: float, max_scale: float, dtype: torch.dtype
               ) -> Tuple[Tensor, Tensor]:
    """Moments (5, G) float64 (``second`` unused) or the buffers var q, var k (G,) -> stats (5, G) float64 (sigma q,
    sigma k, alpha, beta, tau) and (alpha, beta) (2, G) in ``dtype``."""
    stats, ab = _empty(first, dtype)
    _launch(first, second, stats, ab, None, None, None, None, None, a, b, max_scale, 0.0)
    return stats, ab


@torch.library.register_fake(lln_scales)
def _(first, second, a, b, max_scale, dtype):
    return _empty(first, dtype)


@kernel_op("lln_scales_recorded", mutates_args=("buf_q", "buf_k", "batches", "pending"))
def lln_scales_recorded(first: Tensor, second: Tensor, moments: Tensor, buf_q: Tensor, buf_k: Tensor,
                        batches: Optional[Tensor], pending: Optional[Tensor], a: float, b: float, max_scale: float,
                        momentum: float, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``lln_scales`` of ``first``, ``second`` and, in the same program, a training forward's moments (5, G)
    float64 recorded: added to ``pending`` (5, G) float64 if given, else folded into the float32 buffers buf_q,
    buf_k (G,) in place, the running statistics with ``batches`` (the int64 count of batches folded), else an EMA
    (``momentum``). The scales read the buffers as they were before the fold."""
    stats, ab = _empty(first, dtype)
    _launch(first, second, stats, ab, moments, buf_q, buf_k, batches, pending, a, b, max_scale, momentum)
    return stats, ab


@torch.library.register_fake(lln_scales_recorded)
def _(first, second, moments, buf_q, buf_k, batches, pending, a, b, max_scale, momentum, dtype):
    return _empty(first, dtype)


def _launch(first: Tensor, second: Tensor, stats: Tensor, ab: Tensor, moments: Optional[Tensor],
            buf_q: Optional[Tensor], buf_k: Optional[Tensor], batches: Optional[Tensor], pending: Optional[Tensor],
            a: float, b: float, max_scale: float, momentum: float) -> None:
    """``_scales`` in one program: recording ``moments`` (added to ``pending`` or folded into buf_q, buf_k) where
    they are given (LAUNCH's ``lln_moment_fold`` then, else ``lln_moment_scales``)."""
    g = first.shape[-1]
    _scales[(1,)](first, second, stats, ab, moments, buf_q, buf_k, batches, pending, g, A=a, B=b,
                  MAX_SCALE=max_scale, MOMENTS=first.dim() == 2, FOLD=moments is not None and pending is None,
                  PENDING=pending is not None, MOMENTUM=momentum, BATCH=batches is not None,
                  BLOCK=next_power_of_2(g), **launch("lln_moment_scales" if moments is None else "lln_moment_fold", 0))


def _empty(first: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    g = first.shape[-1]
    return first.new_empty((5, g), dtype=torch.float64), first.new_empty((2, g), dtype=dtype)

"""LLN's moment matching after the token sums, in one launch of one program (LLN §4.1, docs/design.md §3.1):
``linattn::lln_scales`` (variances -> sigma, alpha, beta, tau) and, a training forward, ``linattn::lln_scales_recorded``
(the same, and the batch's moments folded into the running statistics, or added to the pending ones, in the same
program). The same float64 arithmetic as ``ops/moment_matching.py`` and the moment matcher's ``_variances``,
``_match`` and ``_fold``, whose two dozen launches of (2, G) tensors each a training forward ran (five dozen in the
modes ``exact`` and ``off``). Every mode: the line a x + b (``paper``, ``fit``), the measured table in its place
(``exact``: ``table``, log s² and log var(log P_LLN) stacked (2, T)) and fixed alpha, beta (``off``, whose tau still
follows the line).
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
LINE, TABLE, FIXED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # the kernels' MODE


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
def _interp(x, xs_ptr, ys_ptr, T, TBLOCK: tl.constexpr):
    """Piecewise-linear y(x) through the T points (xs, ys) (xs ascending), extended by the end segments: the
    segment i with xs[i - 1] < x <= xs[i] (``torch.searchsorted``'s), i in [1, T - 1]."""
    t = tl.arange(0, TBLOCK)
    xs = tl.load(xs_ptr + t, mask=t < T, other=float("inf"))
    i = tl.sum(tl.where(xs[None, :] < x[:, None], 1, 0), 1)
    i = tl.minimum(tl.maximum(i, 1), T - 1)
    x0, x1 = tl.load(xs_ptr + i - 1), tl.load(xs_ptr + i)
    y0, y1 = tl.load(ys_ptr + i - 1), tl.load(ys_ptr + i)
    return y0 + (x - x0) * (y1 - y0) / _clamp_min(x1 - x0, _f64(1e-12))


@triton.jit
def _scale_groups(first_ptr, second_ptr, stats_ptr, ab_ptr, table_ptr, T, g, ok, G, A: tl.constexpr,
                  B: tl.constexpr, MAX_SCALE: tl.constexpr, MOMENTS: tl.constexpr, MODE: tl.constexpr,
                  ALPHA: tl.constexpr, BETA: tl.constexpr, TBLOCK: tl.constexpr):
    """stats (5, G) float64: sigma q, sigma k, alpha, beta, tau; ab (2, G) in its dtype: alpha, beta, of groups g.
    The variances are those of moments (5, G) at ``first_ptr`` (MOMENTS) or the buffers var q, var k (G,) at
    ``first_ptr``, ``second_ptr``. MODE: ``LINE`` (a x + b), ``TABLE`` (the (2, T) table at ``table_ptr``: log s²,
    log var(log P_LLN)) or ``FIXED`` (alpha, beta = ALPHA, BETA; tau on the line)."""
    if MOMENTS:
        vq, vk, _ = _variances(first_ptr, g, ok, G)
    else:
        vq = tl.load(first_ptr + g, mask=ok, other=1.0).to(tl.float64)
        vk = tl.load(second_ptr + g, mask=ok, other=1.0).to(tl.float64)
    a, b, max_scale = _f64(A), _f64(B), _f64(MAX_SCALE)
    sq = _clamp_min(tl.sqrt(vq), _f64(MIN_SIGMA))
    sk = _clamp_min(tl.sqrt(vk), _f64(MIN_SIGMA))
    if MODE == FIXED:
        alpha = tl.full(sq.shape, ALPHA, tl.float64)
        beta = tl.full(sq.shape, BETA, tl.float64)
    else:
        if MODE == TABLE:  # var(log P_LLN) = sigma_q² sigma_k² (eq. 5) on the table, inverted
            target = _clamp_min((sq * sq) * (sk * sk), _f64(1e-300))
            s2 = tl.exp(_interp(tl.log(target), table_ptr + T, table_ptr, T, TBLOCK))
        else:
            s2 = ((sq * sq) * (sk * sk) - b) / _f64(2 * A)  # Prop. 4.1 with eq. 10
        s = tl.sqrt(_clamp_min(s2, _f64(MIN_S2)))
        alpha = _clamp_max(s / sq, max_scale)
        beta = _clamp_max(s / sk, max_scale)
    x = (alpha * alpha) * (sq * sq) + (beta * beta) * (sk * sk)
    if MODE == TABLE:  # the measured curve in place of the line, at s² = x / 2
        var_lln = tl.exp(_interp(tl.log(_clamp_min(x / 2, _f64(MIN_S2))), table_ptr, table_ptr + T, T, TBLOCK))
    else:
        var_lln = a * x + b  # eq. 11
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
def _scales(first_ptr, second_ptr, stats_ptr, ab_ptr, moments_ptr, bq_ptr, bk_ptr, batches_ptr, pending_ptr,
            table_ptr, G, T, A: tl.constexpr, B: tl.constexpr, MAX_SCALE: tl.constexpr, MOMENTS: tl.constexpr,
            MODE: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, TBLOCK: tl.constexpr, FOLD: tl.constexpr,
            PENDING: tl.constexpr, MOMENTUM: tl.constexpr, BATCH: tl.constexpr, BLOCK: tl.constexpr):
    """``_scale_groups`` of every group, then (FOLD) the moments (5, G) at ``moments_ptr`` folded into the buffers
    (``_fold_groups``), or (PENDING) added to the pending moments (5, G) float64 at ``pending_ptr``. The scales read
    the buffers before the fold writes them: the same lanes load and store each group."""
    g = tl.arange(0, BLOCK)
    ok = g < G
    _scale_groups(first_ptr, second_ptr, stats_ptr, ab_ptr, table_ptr, T, g, ok, G, A, B, MAX_SCALE, MOMENTS, MODE,
                  ALPHA, BETA, TBLOCK)
    if FOLD:
        _fold_groups(moments_ptr, bq_ptr, bk_ptr, batches_ptr, g, ok, G, MOMENTUM, BATCH)
    if PENDING:
        for i in tl.static_range(5):
            at = pending_ptr + i * G + g
            tl.store(at, tl.load(at, mask=ok) + tl.load(moments_ptr + i * G + g, mask=ok), mask=ok)


@kernel_op("lln_scales")
def lln_scales(first: Tensor, second: Tensor, a: float, b: float, max_scale: float, fixed_alpha: float,
               fixed_beta: float, table: Optional[Tensor], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Moments (5, G) float64 (``second`` unused) or the buffers var q, var k (G,) -> stats (5, G) float64 (sigma q,
    sigma k, alpha, beta, tau) and (alpha, beta) (2, G) in ``dtype``. The mode: ``fixed_alpha``, ``fixed_beta``
    > 0 (``off``), else ``table`` (2, T) float64 if given (``exact``), else the line a x + b."""
    stats, ab = _empty(first, dtype)
    _launch(first, second, stats, ab, None, None, None, None, None, a, b, max_scale, fixed_alpha, fixed_beta, table,
            0.0)
    return stats, ab


@torch.library.register_fake(lln_scales)
def _(first, second, a, b, max_scale, fixed_alpha, fixed_beta, table, dtype):
    return _empty(first, dtype)


@kernel_op("lln_scales_recorded", mutates_args=("buf_q", "buf_k", "batches", "pending"))
def lln_scales_recorded(first: Tensor, second: Tensor, moments: Tensor, buf_q: Tensor, buf_k: Tensor,
                        batches: Optional[Tensor], pending: Optional[Tensor], a: float, b: float, max_scale: float,
                        fixed_alpha: float, fixed_beta: float, table: Optional[Tensor], momentum: float,
                        dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``lln_scales`` of ``first``, ``second`` and, in the same program, a training forward's moments (5, G)
    float64 recorded: added to ``pending`` (5, G) float64 if given, else folded into the float32 buffers buf_q,
    buf_k (G,) in place, the running statistics with ``batches`` (the int64 count of batches folded), else an EMA
    (``momentum``). The scales read the buffers as they were before the fold."""
    stats, ab = _empty(first, dtype)
    _launch(first, second, stats, ab, moments, buf_q, buf_k, batches, pending, a, b, max_scale, fixed_alpha,
            fixed_beta, table, momentum)
    return stats, ab


@torch.library.register_fake(lln_scales_recorded)
def _(first, second, moments, buf_q, buf_k, batches, pending, a, b, max_scale, fixed_alpha, fixed_beta, table,
      momentum, dtype):
    return _empty(first, dtype)


def _launch(first: Tensor, second: Tensor, stats: Tensor, ab: Tensor, moments: Optional[Tensor],
            buf_q: Optional[Tensor], buf_k: Optional[Tensor], batches: Optional[Tensor], pending: Optional[Tensor],
            a: float, b: float, max_scale: float, fixed_alpha: float, fixed_beta: float, table: Optional[Tensor],
            momentum: float) -> None:
    """``_scales`` in one program: recording ``moments`` (added to ``pending`` or folded into buf_q, buf_k) where
    they are given (LAUNCH's ``lln_moment_fold`` then, else ``lln_moment_scales``)."""
    g = first.shape[-1]
    fixed = fixed_alpha > 0
    mode = (FIXED if fixed else LINE if table is None else TABLE).value
    t = 0 if table is None or fixed else table.shape[-1]
    _scales[(1,)](first, second, stats, ab, moments, buf_q, buf_k, batches, pending, table if t else None, g, t,
                  A=a, B=b, MAX_SCALE=max_scale, MOMENTS=first.dim() == 2, MODE=mode, ALPHA=fixed_alpha,
                  BETA=fixed_beta, TBLOCK=next_power_of_2(t), FOLD=moments is not None and pending is None,
                  PENDING=pending is not None, MOMENTUM=momentum, BATCH=batches is not None,
                  BLOCK=next_power_of_2(g), **launch("lln_moment_scales" if moments is None else "lln_moment_fold", 0))


def _empty(first: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    g = first.shape[-1]
    return first.new_empty((5, g), dtype=torch.float64), first.new_empty((2, g), dtype=dtype)

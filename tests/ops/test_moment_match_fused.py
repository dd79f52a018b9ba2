"""LLN's moment matching after the token sums in one-program kernels (``ops/triton/moment_match.py``, run by
Triton's interpreter) against the moment matcher's own float64 arithmetic (``_variances``, ``_match``, ``_fold``):
groups clamped at each limit, without entries, non-finite; and the matcher with ``--attention-impl fused`` against
``parallel`` over training steps, in one launch a forward after the token sums."""
import contextlib
import math

import pytest
import torch
from helpers import padding_mask

from fairseq_linattn.modules.moment_matcher import MomentMatcher, folds_deferred
from linattn.ops.moment_matching import MIN_SIGMA
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")
from linattn.ops.triton.moment_match import lln_scales, lln_scales_recorded  # noqa: E402

F64 = torch.float64
SQRT_ULPS = dict(rtol=2**-48, atol=0, equal_nan=True)  # 16 ulps: PyTorch's CPU float64 sqrt, rsqrt are ulps off


def moments(gen, g):
    """(5, G) float64 moments of G groups of 40 entries with means and variances spread over decades; with G > 3 one
    group without entries, one with a NaN sum of squares, one of variance ~1e-9 (sigma under MIN_SIGMA), and the
    last of variance 1e4 (alpha, beta over max_scale for small a, b)."""
    count = torch.full((g,), 40.0, dtype=F64)
    mean = torch.randn(2, g, generator=gen, dtype=F64)
    var = torch.exp(4 * torch.randn(2, g, generator=gen, dtype=F64))
    if g > 3:
        count[0] = 0
        var[:, 2] = 1e-9
        var[:, -1] = 1e4
    m = torch.cat([mean * count, (var + mean**2) * count, count[None]])
    if g > 3:
        m[2, 1] = math.nan
    return m


# the modes' own arguments: the line's a, b (fit), the measured table (exact, at N = 64), fixed alpha != beta (off)
MODES = {"fit": dict(b=-0.3), "exact": dict(seq_len=64), "off": dict(fixed_alpha=0.75, fixed_beta=1.5)}


def matcher(g, stats="ema", mode="fit", **kw):
    kw = {**MODES[mode], **kw}
    if mode == "fit":
        kw.setdefault("a", 0.2)
    return MomentMatcher(mode, head_dim=8, num_heads=g, per_head=g > 1, stats=stats, **kw)


def mode_args(m):
    """What the kernels take of ``m``'s mode: fixed alpha, beta (0 where matched) and the table (exact)."""
    return m.fixed_alpha or 0.0, m.fixed_beta or 0.0, m.exact_table if m.mode == "exact" else None


@pytest.mark.parametrize("g", [1, 5, 12])
@pytest.mark.parametrize("source", ["moments", "buffers"])
@pytest.mark.parametrize("max_scale", [8.0, 0.7])
@pytest.mark.parametrize("mode", ["fit", "exact", "off"])
def test_scales_are_the_matchers_arithmetic(gen, g, source, max_scale, mode):
    """sigma, alpha, beta, tau in float64 and alpha, beta in float32, from moments or from the two buffers; a, b, the
    limit and the variances apart from one another (a swapped or float32-rounded constant shows); in every mode:
    the line (fit), the measured table inverted for alpha, beta and read for tau (exact), fixed alpha != beta, over
    the limit or not, with tau on the line (off)."""
    a = 0.13 + 0.1 * torch.rand(1, generator=gen).item()
    m = matcher(g, max_scale=max_scale, mode=mode, **(dict(a=a) if mode == "fit" else {}))
    mom = moments(gen, g)
    if source == "moments":
        var, first, second = m._variances(mom)[0], mom, mom
    else:
        var = torch.rand(2, g, generator=gen, dtype=torch.float32) * 3
        first, second = var[0].clone(), var[1].clone()
    want = m._match(var, like=torch.zeros(1, dtype=torch.float16))
    stats, ab = lln_scales(first, second, m.a, m.b, m.max_scale, *mode_args(m), torch.float32)
    assert stats.dtype == F64 and ab.dtype == torch.float32 and stats.shape == (5, g) and ab.shape == (2, g)
    for row, name in zip(stats[:4], ("sigma_q", "sigma_k", "alpha", "beta")):
        torch.testing.assert_close(row, getattr(m, f"last_{name}"), **SQRT_ULPS)
    # tau = (a x + b)^(-1/2) (eq. 11) with b < 0: where a x is near -b the sum cancels, and alpha's or beta's ulp
    # in x comes back |a x| / |a x + b| times larger (tau halves it again); 16 ulps times that condition number
    x = (m.last_alpha ** 2 * m.last_sigma_q ** 2 + m.last_beta ** 2 * m.last_sigma_k ** 2)
    cond = ((m.a * x).abs() / (m.a * x + m.b).abs()).clamp_min(1.0)
    tau = m.last_tau
    close = (stats[4] - tau).abs() <= SQRT_ULPS["rtol"] * cond * tau.abs()
    assert (close | (stats[4].isnan() & tau.isnan())).all(), (stats[4], tau, cond)
    for got, w in zip(ab, want):
        torch.testing.assert_close(got, w.flatten(), rtol=2**-23, atol=0, equal_nan=True)
    if g > 3 and source == "moments":
        assert stats[0, 0] == stats[1, 0] == 1  # no entry: variance 1
        assert stats[0, 1].isnan()
        if mode == "off":  # the fixed values whatever the statistics
            assert ab[0, 1] == m.fixed_alpha and ab[1, 1] == m.fixed_beta
        else:
            assert ab[0, 1].isnan()  # a NaN variance gives a NaN alpha, for the scale checks
        assert stats[0, 2] == MIN_SIGMA


@pytest.mark.parametrize("g", [1, 3, 12])  # 3: every group folds, in a block of 4 lanes
@pytest.mark.parametrize("stats", ["ema", "batch"])
@pytest.mark.parametrize("folded", [0, 3])
@pytest.mark.parametrize("mode", ["fit", "exact", "off"])
def test_fold_is_the_matchers_fold(gen, g, stats, folded, mode):
    """The float32 buffers bit for bit, and the batch count: a group without entries or with a non-finite variance
    keeps its value, and the running statistics count a batch only if every group folded; the scales of the same
    launch read the buffers as they were before it (the EMA's) or the moments (the batch statistics')."""
    m = matcher(g, stats, mode, ema_momentum=0.9)
    names = ("running_var_q", "running_var_k") if stats == "batch" else ("ema_var_q", "ema_var_k")
    for name in names:
        getattr(m, name).copy_(torch.rand(g, generator=gen) + 0.5)
    if stats == "batch":
        m.running_batches.fill_(folded)
    mom = moments(gen, g)
    before = [getattr(m, name).clone() for name in names]
    batches = m.running_batches.clone() if stats == "batch" else None
    first, second = (mom, mom) if stats == "batch" else before
    want = lln_scales(first.clone(), second.clone(), m.a, m.b, m.max_scale, *mode_args(m), torch.float32)
    got = lln_scales_recorded(first, second, mom, *before, batches, None, m.a, m.b, m.max_scale, *mode_args(m),
                              m.ema_momentum, torch.float32)
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    m._fold_moments(mom)
    for got, name in zip(before, names):
        assert torch.equal(got, getattr(m, name)), name
    if stats == "batch":
        assert batches == m.running_batches == folded + (g <= 3)


@pytest.mark.parametrize("stats", ["ema", "batch"])
@pytest.mark.parametrize("per_head, deferred, mode", [(False, False, "paper"), (True, False, "paper"),
                                                      (True, True, "paper"), (True, False, "exact"),
                                                      (False, True, "exact"), (True, False, "off")])
def test_fused_matcher_trains_as_parallel_in_two_launches(gen, stats, per_head, deferred, mode):
    """Three training forwards of padded half q, k and an eval forward: the same alpha, beta and buffers (the
    pending moments too, ``folds_deferred``) as the ``parallel`` matcher's, with the token rows and one launch
    after them a forward: ``lln_scales_recorded`` a training forward (its fold, or its moments' add to the pending
    ones, in the scales' launch), ``lln_scales`` the EMA's eval forward; in every mode (the measured table's,
    fixed alpha != beta)."""
    q, k = ((s * torch.randn(4, 3, 4, 33, 16, generator=gen) + 0.2).half() for s in (2.0, 0.7))
    masks = [padding_mask(3, 33, side, gen) for side in ("left", "right", "left")]
    kw = {"paper": {}, "exact": dict(seq_len=64), "off": MODES["off"]}[mode]
    fused, parallel = (MomentMatcher(mode, head_dim=16, num_heads=4, per_head=per_head, stats=stats, impl=impl,
                                     **kw).train() for impl in ("fused", "parallel"))
    for step in range(4):
        if step == 3:
            fused.eval(), parallel.eval()
        with count_dispatch() as counts, folds_deferred() if deferred else contextlib.nullcontext():
            got = fused(q[step], k[step], masks[step % 3])
        with folds_deferred() if deferred else contextlib.nullcontext():
            want = parallel(q[step], k[step], masks[step % 3])
        assert counts.ops["lln_scales"] == (stats == "ema" and step == 3)  # eval batch statistics: the matcher's own
        assert counts.ops["lln_scales_recorded"] == (step < 3) and counts.ops["add_"] == 0
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
        for name in ("last_alpha", "last_beta", "last_tau"):
            torch.testing.assert_close(getattr(fused, name), getattr(parallel, name), rtol=1e-5, atol=0)
    for name, buf in parallel.named_buffers():
        torch.testing.assert_close(getattr(fused, name), buf, rtol=1e-5, atol=0)


@pytest.mark.parametrize("stats, mode", [("ema", "paper"), ("batch", "paper"), ("ema", "exact")])
def test_fused_matcher_compiles_whole_and_folds_as_eager(gen, stats, mode):
    """``--attention-compile`` traces the matcher: no graph break, and the fold's in-place update of the buffers
    survives functionalization (aot_eager): the same alpha, beta and buffers as eager, step after step; the exact
    mode's table read as the buffer it is."""
    torch._dynamo.reset()
    kw = dict(seq_len=64) if mode == "exact" else {}
    eager, traced = (MomentMatcher(mode, head_dim=16, num_heads=4, per_head=True, stats=stats, impl="fused",
                                   **kw).train() for _ in range(2))
    compiled = torch.compile(lambda q, k: traced(q, k), fullgraph=True, backend="aot_eager")
    for _ in range(2):
        q, k = ((s * torch.randn(2, 4, 9, 16, generator=gen)).half() for s in (2.0, 0.5))
        for a, b in zip(eager(q, k), compiled(q, k)):
            assert torch.equal(a, b)
        for (name, a), b in zip(eager.named_buffers(), traced.buffers()):
            assert torch.equal(a, b), name


def test_exact_table_stays_float64_through_a_cast():
    """``.half()`` / ``.to(bfloat16)`` leave the exact mode's table (the kernel's copy) the table's float64 values,
    made anew rather than rounded back, and ``.to(float32)`` too."""
    m = MomentMatcher("exact", head_dim=16, num_heads=2, seq_len=64, impl="fused")
    want = torch.stack([m.table.log_s2, m.table.log_var])
    for cast in (torch.Tensor.half, lambda t: t.to(torch.bfloat16), torch.Tensor.float):
        m._apply(cast)
        assert m.exact_table.dtype == F64 and torch.equal(m.exact_table, want)
    assert "exact_table" not in m.state_dict()  # made from (D, N), never saved

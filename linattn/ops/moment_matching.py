"""LLN moment matching (LLN §4.1, Appendix A.7; docs/design.md §3.1): choose alpha, beta so that
var(log P_LLN) equals softmax's var(log P) = sigma_q² sigma_k² (LLN eq. 5, C_cross ignored).

Convention for sigma: sigma_q, sigma_k are the standard deviations of the entries of q, k *as softmax
attention receives them* (scores q·k/sqrt(D)), so softmax's scores have variance sigma_q² sigma_k².
Equivalently, with the symmetric split q~ = q D^(-1/4), k~ = k D^(-1/4) (scores q~·k~), sigma_q =
D^(1/4) std(q~). The LLN features exp(alpha q) depend on q only through alpha q, so var(log P_LLN) is
a function of s = alpha sigma_q = beta sigma_k alone (eq. 10) and of D and N.

Modes: ``paper`` (published a, b), ``fit`` (a, b fitted by Appendix A.7, see ``main``), ``exact``
(inverts a Monte-Carlo table of var(log P_LLN) versus s², so the match holds beyond a linear fit),
``off`` (fixed alpha, beta).

The hook that applies it in a model is ``fairseq_linattn.modules.moment_matcher.MomentMatcher``; the
fit is ``python -m linattn_tools.fit_moments`` (also installed as ``linattn-fit-moments``).
"""
import functools
import json
import math
from typing import Tuple

import torch
from torch import Tensor

from .inputs import check_positive_int

PAPER_A = 0.14855178144710912  # the LLN authors' published constants (preset ``paper``)
PAPER_B = -0.35487039130661086
MODES = ("paper", "fit", "exact", "off")
STATS = ("batch", "ema")
MIN_SIGMA = 1e-3
_MIN_S2 = 1e-8  # s² floor when the target variance is below what the linear model can reach
_F64 = torch.float64


def _as_f64(x, device=None) -> Tensor:
    """float64 tensor; a Python number on the CPU (not on a default device such as meta: it is read back)."""
    if device is None and not isinstance(x, Tensor):
        device = "cpu"
    return torch.as_tensor(x, dtype=_F64, device=device)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_scale_limit(max_scale) -> float:
    if not _is_number(max_scale) or not 0 < max_scale < math.inf:
        raise ValueError(f"max_scale must be a finite number > 0, got {max_scale!r}")
    return float(max_scale)


def _alpha_beta_from_s2(s2: Tensor, sigma_q: Tensor, sigma_k: Tensor, max_scale: float) -> Tuple[Tensor, Tensor]:
    """alpha² sigma_q² = beta² sigma_k² = s² (eq. 10), each clamped to <= max_scale."""
    s = s2.clamp_min(_MIN_S2).sqrt()
    return (s / sigma_q).clamp_max(max_scale), (s / sigma_k).clamp_max(max_scale)


def stacked_alpha_beta(sigma: Tensor, a: float, b: float, max_scale: float) -> Tensor:
    """``lln_alpha_beta`` on sigma = (sigma_q, sigma_k) stacked (2, ...), each >= MIN_SIGMA already, -> (alpha, beta)
    stacked: the same float64 arithmetic in fewer launches (a moment matcher runs it every forward)."""
    s2 = ((sigma ** 2).prod(0) - b) / (2 * a)  # Prop. 4.1 with eq. 10
    return (s2.clamp_min(_MIN_S2).sqrt() / sigma).clamp_max(max_scale)


def lln_alpha_beta(sigma_q, sigma_k, a: float = PAPER_A, b: float = PAPER_B, max_scale: float = 8.0):
    """alpha, beta from LLN Prop. 4.1 with constants a, b: s² = (sigma_q² sigma_k² - b)/(2a).

    Floats give floats; tensors give float64 tensors of the broadcast shape. sigma is clamped to
    >= 1e-3, s² to > 0, alpha and beta to <= max_scale.
    """
    if not _is_number(a) or not a > 0:
        raise ValueError(f"a (the slope of var(log P_LLN) in alpha² sigma_q² + beta² sigma_k²) must be > 0, "
                         f"got {a!r}")
    if not _is_number(b) or not math.isfinite(b):
        raise ValueError(f"b must be a finite number, got {b!r}")
    max_scale = _check_scale_limit(max_scale)
    numbers = _is_number(sigma_q) and _is_number(sigma_k)
    sq, sk = _as_f64(sigma_q).clamp_min(MIN_SIGMA), _as_f64(sigma_k).clamp_min(MIN_SIGMA)
    s2 = (sq ** 2 * sk ** 2 - b) / (2 * a)  # Prop. 4.1 with eq. 10
    alpha, beta = _alpha_beta_from_s2(s2, sq, sk, max_scale)
    return (alpha.item(), beta.item()) if numbers else (alpha, beta)  # sync ok: numbers in, numbers out


@torch.no_grad()
def lln_variance_log_p(alpha_sigma, head_dim: int, seq_len: int, *, num_matrices: int = 64,
                       num_queries: int = 32, seed: int = 0) -> Tensor:
    """Monte-Carlo var(log P_LLN) for Gaussian q, k with alpha sigma_q = beta sigma_k = alpha_sigma.

    Equivalently LLN with alpha = beta = 1 on q, k of std alpha_sigma. ``num_matrices`` independent
    attention matrices, each with ``seq_len`` keys and ``num_queries`` query rows; the variance is
    over all their entries log P_ij (the marginal variance of one entry of an N x N matrix). Every
    value of ``alpha_sigma`` (float or 1-D) reuses the same normal draws, so the curve is smooth.
    Returns float64 of alpha_sigma's shape. Computed in float64 on the CPU.
    """
    check_positive_int("head_dim", head_dim)
    check_positive_int("seq_len", seq_len)
    check_positive_int("num_matrices", num_matrices)
    check_positive_int("num_queries", num_queries)
    scales = _as_f64(alpha_sigma)
    valid = scales.dim() <= 1 and bool(((scales > 0) & torch.isfinite(scales)).all())  # sync ok: offline, CPU
    if not valid:
        raise ValueError(f"alpha_sigma must be a float or 1-D, finite and > 0, got {alpha_sigma!r}")
    flat = scales.reshape(-1)
    gen = torch.Generator().manual_seed(seed)
    sums = torch.zeros(2, flat.numel(), dtype=_F64)
    chunk = 8  # matrices per draw: bounds memory at 8 (N D + num_queries N) float64 values
    for start in range(0, num_matrices, chunk):
        m = min(chunk, num_matrices - start)
        zq = torch.randn(m, num_queries, head_dim, generator=gen, dtype=_F64)
        zk = torch.randn(m, seq_len, head_dim, generator=gen, dtype=_F64)
        # shifts cancel in P: per query row in numerator and denominator, one per matrix for keys
        zq = zq - zq.amax(-1, keepdim=True)
        zk = zk - zk.amax((-2, -1), keepdim=True)
        for i, s in enumerate(flat.tolist()):
            fq, fk = torch.exp(s * zq), torch.exp(s * zk)  # phi_q, phi_k (eq. 8-9), shifted
            denom = fq @ fk.sum(1).unsqueeze(-1)  # (m, queries, 1): phi_q(q_i)^T sum_l phi_k(k_l)
            log_p = (fq @ fk.transpose(1, 2)).div_(denom).log_().add_(math.log(seq_len))
            if not bool(torch.isfinite(log_p).all()):  # sync ok: offline CPU measurement
                raise ValueError(f"alpha_sigma = {s} is too large for a float64 measurement at D = {head_dim}")
            sums[0, i] += log_p.sum()
            sums[1, i] += log_p.square().sum()
    count = num_matrices * num_queries * seq_len
    mean = sums[0] / count
    return (sums[1] / count - mean ** 2).reshape(scales.shape)


def fit_moment_constants(head_dim: int, seq_len: int = 512, sigma_range: Tuple[float, float] = (1.0, 4.0),
                         num_points: int = 16, seed: int = 0) -> Tuple[float, float]:
    """Fit a, b of LLN Prop. 4.1 by Appendix A.7 for head dim D and sequence length N.

    LLN with alpha = beta = 1 on Gaussian q, k whose per-side *variance* sigma~² runs over
    ``sigma_range`` (the paper's "sigma~² in [1, 4]"); least squares of
    var(log P) = a (sigma_q~² + sigma_k~²) + b with sigma_q~² = sigma_k~² = sigma~². Returns (a, b).
    """
    lo, hi = (float(x) for x in sigma_range)
    if not 0 < lo < hi < math.inf:
        raise ValueError(f"sigma_range must be (low, high) variances with 0 < low < high, got {sigma_range!r}")
    if check_positive_int("num_points", num_points) < 2:
        raise ValueError(f"num_points must be >= 2 for a linear fit, got {num_points}")
    var_in = torch.linspace(lo, hi, num_points, dtype=_F64)
    var_log_p = lln_variance_log_p(var_in.sqrt(), head_dim, seq_len, seed=seed)
    x = 2 * var_in  # sigma_q~² + sigma_k~²
    a = ((x - x.mean()) * (var_log_p - var_log_p.mean())).sum() / (x - x.mean()).square().sum()
    b = var_log_p.mean() - a * x.mean()
    return a.item(), b.item()  # sync ok: the fit is an offline CPU computation


def load_constants(path: str) -> dict:
    """Read a JSON written by the ``fit`` command; returns its dict with float ``a`` (> 0) and ``b``."""
    with open(path) as f:
        data = json.load(f)
    for key in ("a", "b"):
        if not isinstance(data, dict) or not _is_number(data.get(key)):
            raise ValueError(f"constants_file {path!r} must be a JSON object with numbers 'a' and 'b'")
    if not data["a"] > 0:
        raise ValueError(f"constants_file {path!r}: 'a' must be > 0, got {data['a']!r}")
    return {**data, "a": float(data["a"]), "b": float(data["b"])}


_REFINE = 8  # table points per Monte-Carlo interval


def _catmull_rom(y: Tensor, factor: int) -> Tensor:
    """Catmull-Rom spline through samples y on a uniform grid, ``factor`` points per interval."""
    p = torch.cat([2 * y[:1] - y[1:2], y, 2 * y[-1:] - y[-2:-1]])  # linear extension past both ends
    p0, p1, p2, p3 = p[:-3, None], p[1:-2, None], p[2:-1, None], p[3:, None]
    t = torch.arange(factor, dtype=y.dtype) / factor
    out = 0.5 * (2 * p1 + (p2 - p0) * t + (2 * p0 - 5 * p1 + 4 * p2 - p3) * t ** 2
                 + (3 * p1 - p0 - 3 * p2 + p3) * t ** 3)
    return torch.cat([out.reshape(-1), y[-1:]])


class ExactMomentTable:
    """Monotone table of var(log P_LLN) versus s² = alpha² sigma_q² = beta² sigma_k² for one (D, N).

    In Prop. 4.1's form a(alpha² sigma_q² + beta² sigma_k²) + b the abscissa is half the sum: the
    table replaces that line by the measured curve. Values are interpolated linearly in
    (log s², log var) on a Catmull-Rom refinement of the Monte-Carlo points (the curve is a power
    law at both ends, var ∝ s² for small and large s); outside the grid the end segments' power
    laws are extended.
    """

    def __init__(self, head_dim: int, seq_len: int = 512, *, s_min: float = 0.1, s_max: float = 16.0,
                 num_points: int = 24, num_matrices: int = 96, num_queries: int = 32, seed: int = 1234):
        self.head_dim, self.seq_len = check_positive_int("head_dim", head_dim), check_positive_int("seq_len", seq_len)
        s = torch.logspace(math.log10(s_min), math.log10(s_max), num_points, dtype=_F64)
        var = lln_variance_log_p(s, head_dim, seq_len, num_matrices=num_matrices, num_queries=num_queries, seed=seed)
        self.log_s2 = _catmull_rom(2 * s.log(), _REFINE)
        # monotone (common draws make it nearly so already)
        self.log_var = torch.cummax(_catmull_rom(var.log(), _REFINE), 0).values
        self._on_device = {}

    def _tables(self, device) -> Tuple[Tensor, Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.log_s2.to(device), self.log_var.to(device))
        return self._on_device[device]

    def stacked(self, device=None) -> Tensor:
        """The table as the fused matcher's kernel reads it: (2, T) float64 on ``device``, log s² and log var."""
        return torch.stack([self.log_s2, self.log_var]).to(device)

    @staticmethod
    def _interp(x: Tensor, xs: Tensor, ys: Tensor) -> Tensor:
        """Piecewise-linear y(x) through (xs, ys), extended by the end segments."""
        i = torch.searchsorted(xs, x.contiguous()).clamp(1, xs.numel() - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (x - x0) * (y1 - y0) / (x1 - x0).clamp_min(1e-12)

    @torch.no_grad()
    def variance(self, s2) -> Tensor:
        """var(log P_LLN) at s² (float or tensor; float64 on s2's device)."""
        s2 = _as_f64(s2, s2.device if isinstance(s2, Tensor) else None).clamp_min(_MIN_S2)
        log_s2, log_var = self._tables(s2.device)
        return self._interp(s2.log(), log_s2, log_var).exp()

    @torch.no_grad()
    def s2_for_variance(self, target) -> Tensor:
        """The s² at which var(log P_LLN) = target (float or tensor; float64 on target's device)."""
        target = _as_f64(target, target.device if isinstance(target, Tensor) else None).clamp_min(1e-300)
        log_s2, log_var = self._tables(target.device)
        return self._interp(target.log(), log_var, log_s2).exp()

    @torch.no_grad()
    def alpha_beta(self, sigma_q, sigma_k, max_scale: float = 8.0):
        """alpha, beta with var(log P_LLN) = sigma_q² sigma_k² (eq. 5 = eq. 10 inverted on the table).

        Same conventions and clamps as ``lln_alpha_beta``; tensors stay on their device.
        """
        max_scale = _check_scale_limit(max_scale)
        numbers = _is_number(sigma_q) and _is_number(sigma_k)
        device = next((x.device for x in (sigma_q, sigma_k) if isinstance(x, Tensor)), None)
        sq, sk = _as_f64(sigma_q, device).clamp_min(MIN_SIGMA), _as_f64(sigma_k, device).clamp_min(MIN_SIGMA)
        alpha, beta = _alpha_beta_from_s2(self.s2_for_variance(sq ** 2 * sk ** 2), sq, sk, max_scale)
        return (alpha.item(), beta.item()) if numbers else (alpha, beta)  # sync ok: numbers in, numbers out


@functools.lru_cache(maxsize=None)
def exact_moment_table(head_dim: int, seq_len: int = 512) -> ExactMomentTable:
    """The ExactMomentTable of (D, N), built once per process (about a second on one CPU core)."""
    return ExactMomentTable(head_dim, seq_len)

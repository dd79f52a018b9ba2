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

Command line: ``python -m fairseq_linattn.ops.moment_matching fit --head-dim 64 --seq-len 512
--range 1 4 --out constants.json`` (also installed as ``linattn-fit-moments``).
"""
import argparse
import contextlib
import contextvars
import functools
import json
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checks import check_key_padding_mask, check_positive_int, compute_dtype

PAPER_A = 0.14855178144710912  # the LLN authors' published constants (preset ``paper``)
PAPER_B = -0.35487039130661086
MODES = ("paper", "fit", "exact", "off")
STATS = ("batch", "ema")
MIN_SIGMA = 1e-3
_MIN_S2 = 1e-8  # s² floor when the target variance is below what the linear model can reach
_F64 = torch.float64
_STATISTICS_LEFT_OUT = contextvars.ContextVar("linattn_statistics_left_out", default=False)


@contextlib.contextmanager
def statistics_left_out():
    """Training forwards inside add no tokens to the batch statistics but still join their all-reduce.

    For fairseq's dummy batches: a rank without data for an update runs a copy of a real batch with
    ``ignore_grad=True``, so that every rank reaches the same collectives.
    """
    token = _STATISTICS_LEFT_OUT.set(True)
    try:
        yield
    finally:
        _STATISTICS_LEFT_OUT.reset(token)


def _as_f64(x, device=None) -> Tensor:
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
    return (alpha.item(), beta.item()) if numbers else (alpha, beta)


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
    if scales.dim() > 1 or not bool(torch.all(scales > 0)) or not bool(torch.all(torch.isfinite(scales))):
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
            if not bool(torch.isfinite(log_p).all()):
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
    return a.item(), b.item()


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
        return (alpha.item(), beta.item()) if numbers else (alpha, beta)


@functools.lru_cache(maxsize=None)
def exact_moment_table(head_dim: int, seq_len: int = 512) -> ExactMomentTable:
    """The ExactMomentTable of (D, N), built once per process (about a second on one CPU core)."""
    return ExactMomentTable(head_dim, seq_len)


class MomentMatcher(nn.Module):
    """The moment-matching hook: (q, k) -> (alpha, beta) for ``lln_attention`` (docs/design.md §3.1).

    mode: paper | fit | exact | off. a, b: Prop. 4.1 constants (default: the paper's; for ``fit``
    read from ``constants_file`` unless given). stats: ``batch`` (the current batch, the authors'
    choice for encoders) or ``ema`` (buffers ``ema_var_q``, ``ema_var_k`` initialised to 1: a forward
    uses the value from before its batch and then, in training only, folds the batch in as
    ema <- ema_momentum * ema + (1 - ema_momentum) * batch, so a causal output never depends on
    future tokens or other sequences; eval uses the frozen buffers). per_head: statistics and
    alpha, beta per head, else per layer. seq_len: the N of the ``exact`` table.

    sigma is the std of all entries of non-padded tokens (all D channels pooled; see the module
    docstring for the convention); with torch.distributed initialised, training statistics are
    all-reduced (sum, sum of squares, count) so every rank uses the same alpha, beta. The last values
    are kept for logging as detached float64 tensors of shape (H,) or (1,): ``last_sigma_q``,
    ``last_sigma_k``, ``last_alpha``, ``last_beta``, ``last_tau`` (tau_lln, eq. 11).
    """

    def __init__(self, mode: str = "paper", *, head_dim: int, num_heads: int = 1, per_head: bool = False,
                 stats: str = "batch", ema_momentum: float = 0.99, max_scale: float = 8.0,
                 a: Optional[float] = None, b: Optional[float] = None, constants_file: Optional[str] = None,
                 fixed_alpha: Optional[float] = None, fixed_beta: Optional[float] = None, seq_len: int = 512):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if stats not in STATS:
            raise ValueError(f"stats must be one of {', '.join(STATS)}; got {stats!r}")
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.num_heads = check_positive_int("num_heads", num_heads)
        if not _is_number(ema_momentum) or not 0 <= ema_momentum < 1:
            raise ValueError(f"ema_momentum must be in [0, 1), got {ema_momentum!r}")
        self.mode, self.stats, self.per_head = mode, stats, bool(per_head)
        self.ema_momentum, self.max_scale = float(ema_momentum), _check_scale_limit(max_scale)
        if (fixed_alpha is None) != (fixed_beta is None) or (mode == "off") != (fixed_alpha is not None):
            raise ValueError("fixed_alpha and fixed_beta are given together, exactly when mode='off'; "
                             f"got mode={mode!r}, fixed_alpha={fixed_alpha!r}, fixed_beta={fixed_beta!r}")
        for name, value in (("fixed_alpha", fixed_alpha), ("fixed_beta", fixed_beta)):
            if value is not None and (not _is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.fixed_alpha, self.fixed_beta = fixed_alpha, fixed_beta
        if constants_file is not None and mode != "fit":
            raise ValueError(f"constants_file is read only with mode='fit', got mode={mode!r}")
        if mode == "fit":
            if (constants_file is None) == (a is None or b is None):
                raise ValueError("mode='fit' needs either constants_file (a JSON written by `python -m "
                                 "fairseq_linattn.ops.moment_matching fit`) or both a and b, not both")
            if constants_file is not None:
                constants = load_constants(constants_file)
                if constants.get("head_dim", head_dim) != head_dim:
                    raise ValueError(f"constants_file {constants_file!r} was fitted for head_dim "
                                     f"{constants['head_dim']}, the model has head_dim {head_dim}")
                a, b = constants["a"], constants["b"]
        self.a = PAPER_A if a is None else a
        self.b = PAPER_B if b is None else b
        lln_alpha_beta(1.0, 1.0, self.a, self.b, self.max_scale)  # validates a, b
        self.seq_len = check_positive_int("seq_len", seq_len)
        self.table = exact_moment_table(head_dim, seq_len) if mode == "exact" else None
        groups = self.num_heads if self.per_head else 1
        if stats == "ema":
            self.register_buffer("ema_var_q", torch.ones(groups))
            self.register_buffer("ema_var_k", torch.ones(groups))
        self.last_sigma_q = self.last_sigma_k = self.last_alpha = self.last_beta = self.last_tau = None

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, stats={self.stats}, per_head={self.per_head}, a={self.a:.6g}, "
                f"b={self.b:.6g}, max_scale={self.max_scale}")

    def _apply(self, fn, *args, **kwargs):
        # .half()/.bfloat16() would round the EMA's 1 % updates away: keep its buffers float32
        super()._apply(fn, *args, **kwargs)
        for name in ("ema_var_q", "ema_var_k"):
            buf = getattr(self, name, None)
            if buf is not None and buf.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, buf.float())
        return self

    def _batch_variances(self, q: Tensor, k: Tensor,
                         key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """Variances of q and k entries over non-padded tokens and their count, each (G,); all-reduced in
        training, where a forward inside ``statistics_left_out`` adds nothing (variances 1 for no tokens)."""
        dims = (0, 2, 3) if self.per_head else (0, 1, 2, 3)
        keep = None if key_padding_mask is None else (~key_padding_mask)[:, None, :, None].to(_F64)
        moments = []
        for x in (q, k):
            x = x.detach().to(_F64)
            xw = x if keep is None else x * keep
            moments += [xw.sum(dims).reshape(-1), (xw * x).sum(dims).reshape(-1)]
        tokens = q.shape[0] * q.shape[2] if keep is None else keep.sum()
        count = _as_f64(tokens, q.device) * q.shape[3] * (1 if self.per_head else q.shape[1])
        moments.append(count.expand_as(moments[0]))
        moments = torch.stack(moments)  # (5, G): sum q, sum q², sum k, sum k², count
        if self.training and _STATISTICS_LEFT_OUT.get():
            moments = torch.zeros_like(moments)  # a dummy batch: joins the all-reduce with nothing
        if self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(moments)
        count = moments[4]
        n, empty = count.clamp_min(1), count <= 0  # no token on any rank: variance 1, which an EMA does not fold in
        mean_q, mean_k = moments[0] / n, moments[2] / n
        var_q, var_k = (moments[1] / n - mean_q ** 2).clamp_min(0), (moments[3] / n - mean_k ** 2).clamp_min(0)
        return var_q.masked_fill(empty, 1.0), var_k.masked_fill(empty, 1.0), count

    def _match(self, var_q: Tensor, var_k: Tensor, like: Tensor) -> Tuple[Tensor, Tensor]:
        sigma_q, sigma_k = var_q.to(_F64).sqrt().clamp_min(MIN_SIGMA), var_k.to(_F64).sqrt().clamp_min(MIN_SIGMA)
        if self.mode == "off":
            alpha, beta = torch.full_like(sigma_q, self.fixed_alpha), torch.full_like(sigma_q, self.fixed_beta)
        elif self.mode == "exact":
            alpha, beta = self.table.alpha_beta(sigma_q, sigma_k, self.max_scale)
        else:
            alpha, beta = lln_alpha_beta(sigma_q, sigma_k, self.a, self.b, self.max_scale)
        x = alpha ** 2 * sigma_q ** 2 + beta ** 2 * sigma_k ** 2
        # eq. 11; the exact table replaces the line a x + b by the measured curve at s² = x / 2
        var_lln = self.table.variance(x / 2) if self.mode == "exact" else self.a * x + self.b
        self.last_sigma_q, self.last_sigma_k, self.last_alpha, self.last_beta = sigma_q, sigma_k, alpha, beta
        self.last_tau = var_lln.clamp_min(1e-12).rsqrt()
        shape = (1, -1, 1, 1)
        return alpha.to(compute_dtype(like)).view(shape), beta.to(compute_dtype(like)).view(shape)

    def forward(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """q, k (B, H, N, D) -> alpha, beta of shape (1, H, 1, 1) per head or (1, 1, 1, 1) per layer.

        key_padding_mask (B, N), True = padding, masks the tokens of both q and k (self-attention).
        """
        for name, x in (("q", q), ("k", k)):
            if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor of shape (B, H, N, D), got "
                                 f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[1] != self.num_heads and self.per_head:
            raise ValueError(f"q, k must share B, H (= num_heads {self.num_heads} per head) and D, got "
                             f"{tuple(q.shape)} and {tuple(k.shape)}")
        key_padding_mask = check_key_padding_mask(key_padding_mask, k)
        if key_padding_mask is not None and q.shape[2] != k.shape[2]:
            raise ValueError(f"key_padding_mask masks the tokens of q and k, which must then have the same "
                             f"length, got {q.shape[2]} and {k.shape[2]}")
        trained_on = self.training and torch.is_grad_enabled()
        with torch.no_grad():  # alpha, beta are constants for autograd
            return self._statistics(q, k, key_padding_mask, trained_on)

    def _statistics(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], trained_on: bool):
        if self.stats == "batch":
            return self._match(*self._batch_variances(q, k, key_padding_mask)[:2], like=q)
        var_q, var_k = self.ema_var_q.clone(), self.ema_var_k.clone()  # the value from before this batch
        # fold the batch in only on a forward that will be trained on: under activation checkpointing
        # the first pass runs without grad and the recomputation in backward must see the same buffer
        if trained_on:
            batch_q, batch_k, count = self._batch_variances(q, k, key_padding_mask)
            # a batch with inf/NaN activations (an fp16 overflow, whose update the loss scaler skips)
            # is not folded in: a non-finite buffer would make every later alpha, beta and loss NaN;
            # nor is one without tokens (every rank on a dummy batch)
            finite = torch.isfinite(batch_q) & torch.isfinite(batch_k) & (count > 0)
            m = self.ema_momentum
            for buf, batch in ((self.ema_var_q, batch_q), (self.ema_var_k, batch_k)):
                old = buf.to(_F64)
                buf.copy_(torch.where(finite, m * old + (1 - m) * batch, old))
        return self._match(var_q, var_k, like=q)

    @torch.no_grad()
    def current(self, like: Tensor) -> Tuple[Tensor, Tensor]:
        """alpha, beta from the running (EMA) statistics, looking at no token (incremental decoding).

        ``like`` only gives the device and dtype. Needs stats='ema' unless mode='off'.
        """
        if self.stats != "ema" and self.mode != "off":
            raise ValueError(f"current() needs stats='ema' (or mode='off'), got stats={self.stats!r}")
        if self.stats == "ema":
            return self._match(self.ema_var_q, self.ema_var_k, like=like)
        ones = torch.ones(1, dtype=_F64, device=like.device)
        return self._match(ones, ones, like=like)


def main(argv=None) -> None:
    """Command line: ``fit`` writes fitted a, b (LLN Appendix A.7) to a JSON for --lln-constants-file."""
    parser = argparse.ArgumentParser(prog="python -m fairseq_linattn.ops.moment_matching",
                                     description="LLN moment-matching constants (docs/design.md §3.1)")
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit a, b of var(log P_LLN) = a (sigma_q~² + sigma_k~²) + b (LLN A.7)")
    fit.add_argument("--head-dim", type=int, required=True, help="attention head dim D")
    fit.add_argument("--seq-len", type=int, default=512, help="sequence length N (default 512)")
    fit.add_argument("--range", type=float, nargs=2, default=(1.0, 4.0), metavar=("LOW", "HIGH"),
                     help="per-side input variance range sigma~² (default: the paper's 1 4)")
    fit.add_argument("--num-points", type=int, default=16, help="variances sampled in the range (default 16)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", required=True, help="output JSON path")
    args = parser.parse_args(argv)
    a, b = fit_moment_constants(args.head_dim, args.seq_len, tuple(args.range), args.num_points, args.seed)
    result = {"a": a, "b": b, "head_dim": args.head_dim, "seq_len": args.seq_len, "range": list(args.range)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

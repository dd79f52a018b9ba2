"""The moment-matching hook of an LLN module (LLN §4.1; docs/design.md §3.1): running statistics of
q and k -> alpha, beta. The formulas are the pure functions of ``linattn.ops.moment_matching``;
this module keeps the state (EMA buffers), the train/eval behaviour and the all-reduce across ranks.
"""
import contextlib
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from linattn.ops import check_key_padding_mask, check_positive_int, compute_dtype, token_moments
from linattn.ops.impls import IMPLS, implementation_for
from linattn.ops.lln.autograd import IMPLEMENTATIONS as LLN_IMPLEMENTATIONS
from linattn.ops.moment_matching import (
    MIN_SIGMA,
    MODES,
    PAPER_A,
    PAPER_B,
    STATS,
    _check_scale_limit,
    _is_number,
    exact_moment_table,
    lln_alpha_beta,
    load_constants,
    stacked_alpha_beta,
)

_F64 = torch.float64
# what a forward keeps for logging (plain attributes, assigned one by one: Dynamo on torch 2.11 breaks the graph at
# an update of the module's ``__dict__``)
LAST = ("last_sigma_q", "last_sigma_k", "last_alpha", "last_beta", "last_tau")


class _TrainingFlags:
    """The switches of the two context managers below: plain attributes, which ``torch.compile`` reads and guards
    (``--attention-compile``: a ContextVar's ``get`` would break the graph in every training forward)."""

    statistics_left_out = False
    folds_deferred = False


_FLAGS = _TrainingFlags()


@contextlib.contextmanager
def _flag_set(name: str):
    before = getattr(_FLAGS, name)
    setattr(_FLAGS, name, True)
    try:
        yield
    finally:
        setattr(_FLAGS, name, before)


@contextlib.contextmanager
def statistics_left_out():
    """Training forwards inside add no tokens to the batch statistics but still join their all-reduce.

    For fairseq's dummy batches: a rank without data for an update runs a copy of a real batch with
    ``ignore_grad=True``, so that every rank reaches the same collectives.
    """
    with _flag_set("statistics_left_out"):
        yield


@contextlib.contextmanager
def folds_deferred():
    """Training forwards inside add their batch's moments to ``pending_moments`` instead of folding them into the
    running statistics at once; ``fold_pending`` folds them (fairseq's optimizer step, after one all-reduce of every
    layer's pending moments: ``fairseq_linattn.moment_sync``)."""
    with _flag_set("folds_deferred"):
        yield


class MomentMatcher(nn.Module):
    """The moment-matching hook: (q, k) -> (alpha, beta) for ``lln_attention`` (docs/design.md §3.1).

    mode: paper | fit | exact | off. a, b: Prop. 4.1 constants (default: the paper's; for ``fit``
    read from ``constants_file`` unless given). stats: ``batch`` (in training the current batch, the
    authors' choice for encoders, also folded into running statistics ``running_var_q``,
    ``running_var_k`` as batch normalisation does, with ``running_batches`` the batches folded in; eval
    uses the frozen running statistics, or each sequence's own statistics while none were folded in,
    so that eval never depends on the other sequences of a batch) or ``ema`` (buffers ``ema_var_q``,
    ``ema_var_k`` initialised to 1: a forward
    uses the value from before its batch and then, in training only, folds the batch in as
    ema <- ema_momentum * ema + (1 - ema_momentum) * batch, so a causal output never depends on
    future tokens or other sequences; eval uses the frozen buffers). per_head: statistics and
    alpha, beta per head, else per layer. seq_len: the N of the ``exact`` table. impl: the attention's
    ``--attention-impl``, which ``ops.token_moments`` and the matching follow (LLN's implementation's own kernels
    where its file has them: ``fused``'s row sums in one kernel, the matching in one-program kernels).

    sigma is the std of all entries of non-padded tokens (all D channels pooled; see the module
    docstring for the convention). A training forward's ``batch`` statistics are its own rank's (as batch
    normalisation's) under fairseq's trainer, where every layer's moments (sum, sum of squares, count) wait in
    ``pending_moments`` and are all-reduced together once per update (``folds_deferred``); elsewhere, with
    torch.distributed initialised, each training forward all-reduces its own and uses the global batch's. Either
    way every rank folds the global batch's statistics, so all keep the same running statistics. The last values
    are kept for logging as detached float64 tensors of shape (H,) or (1,): ``last_sigma_q``,
    ``last_sigma_k``, ``last_alpha``, ``last_beta``, ``last_tau`` (tau_lln, eq. 11).
    """

    def __init__(self, mode: str = "paper", *, head_dim: int, num_heads: int = 1, per_head: bool = False,
                 stats: str = "batch", ema_momentum: float = 0.99, max_scale: float = 8.0,
                 a: Optional[float] = None, b: Optional[float] = None, constants_file: Optional[str] = None,
                 fixed_alpha: Optional[float] = None, fixed_beta: Optional[float] = None, seq_len: int = 512,
                 impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
        self.impl = impl  # the attention's implementation (--attention-impl), whose own kernels the matching runs
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
                                 "linattn_tools.fit_moments`) or both a and b, not both")
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
        if self.table is not None:  # as the fused matcher's kernel reads it, moved with the module (kept float64)
            self.register_buffer("exact_table", self.table.stacked(), persistent=False)
        groups = self.num_heads if self.per_head else 1
        if stats == "ema":
            self.register_buffer("ema_var_q", torch.ones(groups))
            self.register_buffer("ema_var_k", torch.ones(groups))
        else:  # eval's statistics; a checkpoint without them gets these values, running_batches = 0
            self.register_buffer("running_var_q", torch.ones(groups))
            self.register_buffer("running_var_k", torch.ones(groups))
            self.register_buffer("running_batches", torch.zeros((), dtype=torch.long))
        # sum q, sum q², sum k, sum k², token entries of the training forwards not folded in yet (folds_deferred)
        self.register_buffer("pending_moments", torch.zeros(5, groups, dtype=_F64), persistent=False)
        self.last_sigma_q = self.last_sigma_k = self.last_alpha = self.last_beta = self.last_tau = None

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, stats={self.stats}, per_head={self.per_head}, a={self.a:.6g}, "
                f"b={self.b:.6g}, max_scale={self.max_scale}")

    def _apply(self, fn, *args, **kwargs):
        # .half()/.bfloat16() would round the EMA's 1 % updates away: keep its buffers float32
        super()._apply(fn, *args, **kwargs)
        for name in ("ema_var_q", "ema_var_k", "running_var_q", "running_var_k"):
            buf = getattr(self, name, None)
            if buf is not None and buf.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, buf.float())
        self.pending_moments = self.pending_moments.to(_F64)  # sums over many tokens: float64
        if self.table is not None and self.exact_table.dtype != _F64:  # made anew, not rounded back
            self.exact_table = self.table.stacked(self.exact_table.device)
        return self

    def train(self, mode: bool = True):
        """fairseq's trainer calls ``model.train()`` at the start of every update attempt: the moments of an attempt
        it skipped (gradient overflow, out of memory) are dropped here, never folded."""
        if mode:
            self.pending_moments.zero_()
        return super().train(mode)

    def _moments(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], per_sequence: bool = False,
                 kernels=None) -> Tensor:
        """(5, G) or (5, B, G) for ``per_sequence``: sum q, sum k, sum q², sum k², entries, over non-padded tokens
        (q's and k's stacked: fewer launches).

        Each token row's D entries are reduced first, in float32 straight from the input dtype (float64 for float64
        q, k), with no full-size upcast copy of q or k, and counted (D a real row, 0 a padded one, which adds 0
        whatever it holds, inf or NaN included: ``ops.token_moments``, one kernel with ``--attention-impl fused``);
        the (5, B, H, N) rows are then summed over the tokens in float64 (sums over many tokens), in one reduction.
        ``kernels``: ``_kernels(q)``, whose rows those are where it has them.
        """
        own = getattr(kernels, "token_moments", None)  # the rows ``token_moments`` runs there, its choice not redone
        q, k = q.detach(), k.detach()
        rows = token_moments(q, k, key_padding_mask, self.impl) if own is None else own(q, k, key_padding_mask)
        dims = (3,) if self.per_head else (2, 3)
        if per_sequence:
            return rows.sum(dims, dtype=_F64).reshape(5, q.shape[0], -1)
        return rows.sum((1,) + dims, dtype=_F64).reshape(5, -1)

    @staticmethod
    def _variances(moments: Tensor) -> Tuple[Tensor, Tensor]:
        """Variances of q's and k's entries stacked (2, ...) and their count, from ``_moments``; variance 1 where
        there is no token."""
        count = moments[4]
        n, empty = count.clamp_min(1), count <= 0  # no token on any rank: variance 1, which an EMA does not fold in
        mean = moments[:2] / n
        var = (moments[2:4] / n - mean ** 2).clamp_min(0)
        return var.masked_fill(empty, 1.0), count

    def _kernels(self, like: Tensor):
        """The file of LLN's implementation for q like ``like`` where the matching after the token sums runs in its
        one-program kernels (its ``lln_scales`` and ``lln_scales_recorded``: ``fused``'s), in every mode; else
        None."""
        implementation = LLN_IMPLEMENTATIONS[implementation_for(LLN_IMPLEMENTATIONS, self.impl, like)]
        return implementation if hasattr(implementation, "lln_scales") else None

    def _scales(self, like: Tensor, kernels, moments: Optional[Tensor] = None,
                record: Optional[Tuple[Tensor, bool]] = None) -> Tuple[Tensor, Tensor]:
        """alpha, beta (as ``forward``) from the variances of moments (5, G) or, without them, the EMA buffers: one
        launch of ``kernels.lln_scales`` (``_kernels(like)``) if given, else ``_match``'s two dozen. ``record``
        (with kernels): a training forward's moments as ``_recorded`` gives them, recorded by the same launch
        (``kernels.lln_scales_recorded``: the buffers read before the fold writes them)."""
        if kernels is None:
            var = torch.stack([self.ema_var_q, self.ema_var_k]) if moments is None else self._variances(moments)[0]
            return self._match(var, like)
        first, second = (self.ema_var_q, self.ema_var_k) if moments is None else (moments, moments)
        mode = (self.fixed_alpha or 0.0, self.fixed_beta or 0.0, self.exact_table if self.table is not None else None)
        if record is None:
            stats, ab = kernels.lln_scales(first, second, self.a, self.b, self.max_scale, *mode, compute_dtype(like))
        else:
            batches = self.running_batches if self.stats == "batch" else None
            stats, ab = kernels.lln_scales_recorded(
                first, second, record[0], *self._folded_into(), batches, self.pending_moments if record[1] else None,
                self.a, self.b, self.max_scale, *mode, self.ema_momentum, compute_dtype(like))
        self._keep_last(stats.unbind(0))
        return ab[0].view(1, -1, 1, 1), ab[1].view(1, -1, 1, 1)

    def _keep_last(self, values: Tuple[Tensor, ...]) -> None:
        """``LAST``'s values set, straight into the instance's attributes (they are no parameters, buffers or
        modules: ``nn.Module.__setattr__`` costs the host about 3 µs each to find that out), one by one under
        ``torch.compile`` (``LAST``)."""
        if torch.compiler.is_compiling():
            self.last_sigma_q, self.last_sigma_k, self.last_alpha, self.last_beta, self.last_tau = values
        else:
            self.__dict__.update(zip(LAST, values))

    def _match(self, var: Tensor, like: Tensor) -> Tuple[Tensor, Tensor]:
        """alpha, beta (as ``forward``) from the variances of q and k stacked (2, ...)."""
        sigma = var.to(_F64).sqrt().clamp_min(MIN_SIGMA)
        if self.mode == "off":
            ab = torch.tensor([self.fixed_alpha, self.fixed_beta], dtype=_F64, device=sigma.device)
            ab = ab.view(2, *(1,) * (sigma.dim() - 1)).expand_as(sigma)
        elif self.mode == "exact":
            ab = torch.stack(self.table.alpha_beta(sigma[0], sigma[1], self.max_scale))
        else:
            ab = stacked_alpha_beta(sigma, self.a, self.b, self.max_scale)
        x = (ab ** 2 * sigma ** 2).sum(0)
        # eq. 11; the exact table replaces the line a x + b by the measured curve at s² = x / 2
        var_lln = self.table.variance(x / 2) if self.mode == "exact" else self.a * x + self.b
        self.last_sigma_q, self.last_sigma_k, self.last_alpha, self.last_beta = sigma[0], sigma[1], ab[0], ab[1]
        self.last_tau = var_lln.clamp_min(1e-12).rsqrt()
        shape = (sigma.shape[1] if sigma.dim() == 3 else 1, -1, 1, 1)  # (B, G) per sequence
        ab = ab.to(compute_dtype(like))
        return ab[0].view(shape), ab[1].view(shape)

    def forward(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, *,
                peek: bool = False) -> Tuple[Tensor, Tensor]:
        """q, k (B, H, N, D) -> alpha, beta of shape (1, H, 1, 1) per head or (1, 1, 1, 1) per layer;
        (B, H or 1, 1, 1) with per-sequence statistics (``batch`` in eval before any running statistics).

        key_padding_mask (B, N), True = padding, masks the tokens of both q and k (self-attention).
        peek: the values this forward would use, with no buffer updated and nothing all-reduced.
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
        trained_on = self.training and torch.is_grad_enabled() and not peek
        with torch.no_grad():  # alpha, beta are constants for autograd
            return self._statistics(q, k, key_padding_mask, trained_on)

    def _statistics(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], trained_on: bool):
        kernels = self._kernels(q)
        if self.stats == "batch":
            if self.training:
                moments = self._training_moments(q, k, key_padding_mask, kernels)
                if trained_on and kernels is not None:  # recorded by the scales' launch
                    record = self._recorded(moments)
                    return self._scales(q, kernels, record[0], record)
                if trained_on:
                    moments = self._record(moments)
                return self._scales(q, kernels, moments)
            # eval: the running statistics; before any training batch (a model not trained yet, or a checkpoint
            # saved before they were kept, whose load logs the buffers it starts fresh) each sequence's own.
            # Chosen on the device, with no host sync: (2, B, G) either way
            own = self._variances(self._moments(q, k, key_padding_mask, per_sequence=True))[0]
            running = torch.stack([self.running_var_q, self.running_var_k]).to(_F64)[:, None]
            return self._match(torch.where(self.running_batches > 0, running, own), like=q)
        # fold the batch in only on a forward that will be trained on: under activation checkpointing
        # the first pass runs without grad and the recomputation in backward must see the same buffer
        if trained_on and kernels is not None:  # the value from before this batch, and its fold, in one launch
            return self._scales(q, kernels, record=self._recorded(self._training_moments(q, k, key_padding_mask,
                                                                                         kernels)))
        # the value from before this batch (computed first: the fold below updates the buffers in place)
        alpha_beta = self._scales(q, kernels)
        if trained_on:
            self._record(self._training_moments(q, k, key_padding_mask, kernels))
        return alpha_beta

    def _training_moments(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], kernels) -> Tensor:
        """``_moments`` of a training forward; none (variance 1) inside ``statistics_left_out``."""
        moments = self._moments(q, k, key_padding_mask, kernels=kernels)
        return torch.zeros_like(moments) if _FLAGS.statistics_left_out else moments

    def _recorded(self, moments: Tensor) -> Tuple[Tensor, bool]:
        """A training forward's moments as recorded and whether they wait in ``pending_moments``
        (``folds_deferred``: the rank's own) rather than being folded now (all-reduced first when torch.distributed
        is initialised)."""
        if _FLAGS.folds_deferred:
            return moments, True
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            moments = moments.clone()
            dist.all_reduce(moments)
        return moments, False

    def _record(self, moments: Tensor) -> Tensor:
        """``_recorded``'s moments added to ``pending_moments`` or folded now; returned."""
        moments, pending = self._recorded(moments)
        if pending:
            self.pending_moments.add_(moments)
        else:
            self._fold_moments(moments)
        return moments

    def fold_pending(self) -> None:
        """Fold ``pending_moments`` (all-reduced by the caller) into the running statistics, then clear them."""
        self._fold_moments(self.pending_moments)
        self.pending_moments.zero_()

    def _fold_moments(self, moments: Tensor) -> None:
        """``_fold`` the variances of moments (5, G) into the running statistics."""
        self._fold(*self._variances(moments), *self._folded_into())

    def _folded_into(self) -> Tuple[Tensor, Tensor]:
        """The running variances of q and k a fold updates: the batch statistics' or the EMA's."""
        if self.stats == "batch":
            return self.running_var_q, self.running_var_k
        return self.ema_var_q, self.ema_var_k

    def _fold(self, batch: Tensor, count: Tensor, buf_q: Tensor, buf_k: Tensor) -> None:
        """buf <- m buf + (1 - m) batch (``batch``: q's and k's stacked); ``batch`` stats: the running statistics'
        first batches are averaged with equal weights (weight 1 / (n + 1) for the (n + 1)-th while it exceeds
        1 - m), so that the initial 1 leaves no trace."""
        # a batch with inf/NaN activations (an fp16 overflow, whose update the loss scaler skips)
        # is not folded in: a non-finite buffer would make every later alpha, beta and loss NaN;
        # nor is one without tokens (every rank on a dummy batch). Variances are >= 0 or NaN: finite is < inf
        finite = (batch < math.inf).all(0) & (count > 0)
        m = self.ema_momentum
        if self.stats == "batch":
            m = torch.clamp(1 - 1 / (self.running_batches.to(_F64) + 1), max=m)
            self.running_batches.add_(finite.all().long())
        old = torch.stack([buf_q, buf_k]).to(_F64)
        new = torch.where(finite, m * old + (1 - m) * batch, old)
        buf_q.copy_(new[0])
        buf_k.copy_(new[1])

    @torch.no_grad()
    def current(self, like: Tensor) -> Tuple[Tensor, Tensor]:
        """alpha, beta from the running (EMA) statistics, looking at no token (incremental decoding).

        ``like`` only gives the device and dtype. Needs stats='ema' unless mode='off'.
        """
        if self.stats != "ema" and self.mode != "off":
            raise ValueError(f"current() needs stats='ema' (or mode='off'), got stats={self.stats!r}")
        if self.stats == "ema":
            return self._scales(like, self._kernels(like))
        return self._match(torch.ones(2, 1, dtype=_F64, device=like.device), like=like)

"""Attention modules with fairseq's ``MultiheadAttention`` interface, one class per method.

Each module owns ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (fairseq's names, so a softmax
checkpoint loads into any variant), reshapes fairseq's time-first (T, B, C) to the ops' (B, H, T, D),
calls its op, and keeps an O(1)-or-O(window) incremental state for decoding. Causality is fixed at
construction (decoder self-attention), never inferred from a mask.
"""
import functools
import logging
import math
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq.incremental_decoding_utils import with_incremental_state

from linattn import ops
from linattn.methods import METHODS, AttentionConfig, methods_for
from linattn.ops import check_key_padding_mask, compute_dtype, lln_decode_init, lln_decode_step, mix_lln_diag
from .moment_matcher import MomentMatcher

State = Dict[str, Optional[Tensor]]
logger = logging.getLogger(__name__)


def _real_first_order(key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """(B, N) order putting each row's real tokens first (in their order), or None if they already are."""
    if key_padding_mask is None or not bool((key_padding_mask[:, :-1] & ~key_padding_mask[:, 1:]).any()):
        return None
    return torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True).indices


def _tokens(x: Optional[Tensor], order: Tensor, dim: int = 2) -> Optional[Tensor]:
    """x with its tokens (along ``dim``, batch on dim 0) in ``order`` (B, N)."""
    if x is None:
        return None
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = order.shape[1]
    return x.gather(dim, order.view(shape).expand(*x.shape[:dim], order.shape[1], *x.shape[dim + 1:]))


def over_real_tokens(fn):
    """For a method whose blocks or windows count positions: ``fn(self, q, k, v, key_padding_mask, ...)`` runs
    with each row's real tokens first, so that padding anywhere (left padding too) changes no real token's
    output and real tokens are counted as fairseq counts their positions (docs/design.md §1.2)."""
    @functools.wraps(fn)
    def run(self, q, k, v, key_padding_mask=None, *args, **kwargs):
        order = None if self.cross else _real_first_order(key_padding_mask)
        if order is None:
            return fn(self, q, k, v, key_padding_mask, *args, **kwargs)
        out = fn(self, _tokens(q, order), _tokens(k, order), _tokens(v, order), _tokens(key_padding_mask, order, 1),
                 *args, **kwargs)
        return _tokens(out, order.argsort(1))
    return run


def rows_over_real_tokens(fn):
    """``over_real_tokens`` for ``attention_rows(self, q, k, key_padding_mask, rows, lln)``: the matrix of the
    reordered tokens, put back in the tokens' own order (rows and columns)."""
    @functools.wraps(fn)
    def run(self, q, k, key_padding_mask=None, rows=None, lln=None):
        order = None if self.cross else _real_first_order(key_padding_mask)
        if order is None:
            return fn(self, q, k, key_padding_mask, rows, lln)
        p = fn(self, _tokens(q, order), _tokens(k, order), _tokens(key_padding_mask, order, 1), None, lln)
        back = order.argsort(1)
        p = _tokens(_tokens(p, back, 2), back, 3)
        return p[:, :, ops.select_rows(rows, q.shape[2], q.device)]
    return run


@with_incremental_state
class AttentionBase(nn.Module):
    """Projections, layout and incremental-state plumbing shared by every method."""

    method = "base"  # its name in linattn.methods.METHODS
    takes_attn_mask = False  # an arbitrary (T, S) attn_mask, beyond causality fixed at construction
    uses_keys = True  # False for a method whose output never reads the keys (LAVO cross-attention)
    caches_source = False  # True for a cross-attention that keeps only a summary of its source
    is_kernel_method = False  # True: ``attention_rows`` normalises the rows of a kernel C (out = C V), ``kernel_rows``

    def __init__(self, embed_dim: int, num_heads: int, *, config: Optional[AttentionConfig] = None,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, dropout: float = 0.0, causal: bool = False,
                 cross: bool = False, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if causal and "decoder" not in METHODS[self.method].roles:
            raise ValueError(f"{self.method} is a non-causal method and cannot be causal (decoder) "
                             f"self-attention; causal methods: {', '.join(methods_for('decoder'))}")
        self.config = AttentionConfig() if config is None else config
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.cross = causal, cross
        self.dropout = dropout
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        # fairseq MultiheadAttention's initialisation
        gain = 1 / math.sqrt(2) if kdim == vdim == embed_dim else 1.0
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if bias:
            nn.init.constant_(self.out_proj.bias, 0.0)

    # -- layout ---------------------------------------------------------------------------------
    def _heads(self, x: Tensor) -> Tensor:
        """(T, B, C) -> (B, H, T, D)."""
        t, b, _ = x.shape
        return x.view(t, b, self.num_heads, -1).permute(1, 2, 0, 3)

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None, incremental_state=None, need_weights: bool = True,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
                need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """query (T, B, C), key/value (S, B, C) -> ((T, B, C), weights or None), as fairseq's MHA.

        Decoding (``incremental_state``): a causal module takes its tokens one at a time with a (B, T)
        or (B, 1) ``key_padding_mask`` for them (or None when they are all real, as fairseq's decoder
        passes it); a module that caches its source (``static_kv``) reads it once per source.
        """
        if before_softmax:
            raise ValueError(f"{self.method} attention has no pre-softmax scores (before_softmax=True)")
        key = query if key is None else key
        value = key if value is None else value
        t, b, _ = query.shape
        attn_mask = self._accepted_attn_mask(attn_mask, t, key.shape[0], incremental_state is not None)
        q = self._heads(self.q_proj(query))
        k = None
        if incremental_state is not None and static_kv and self.caches_source:
            state = self._get_input_buffer(incremental_state)
            if not state:  # first step of this source: read it once, keep what the method needs of it
                state = self.source_state(self._heads(self.v_proj(value)), key_padding_mask)
                self._set_input_buffer(incremental_state, state)
            out = self.attend_source(q, state)
        elif incremental_state is not None and self.causal:
            k, v = self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
            state = self._get_input_buffer(incremental_state)
            outs = []
            for i in range(t):  # fairseq feeds one token per step; a longer prompt goes token by token
                kpm = None if key_padding_mask is None else key_padding_mask[:, -t + i:][:, :1]
                out_i, state = self.step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], kpm, state)
                outs.append(out_i)
            self._set_input_buffer(incremental_state, state)
            out = torch.cat(outs, 2)
        else:
            k = self._heads(self.k_proj(key)) if self.uses_keys else None
            out = self.attend(q, k, self._heads(self.v_proj(value)), key_padding_mask, attn_mask)
        out = out.permute(2, 0, 1, 3).reshape(t, b, self.embed_dim)
        weights = None
        if (need_weights or need_head_weights) and incremental_state is None:
            weights = self.attention_weights(q, k, key_padding_mask, attn_mask)  # (B, H, T, S) if the method has them
            if weights is not None:  # fairseq's layout: (H, B, T, S) per head, else the mean over heads
                weights = weights.transpose(0, 1) if need_head_weights else weights.mean(1)
        return self.out_proj(out), weights

    def _accepted_attn_mask(self, attn_mask: Optional[Tensor], t: int, s: int, decoding: bool) -> Optional[Tensor]:
        """The attn_mask ``attend`` must apply: None when there is none or it is the future mask a causal
        module applies anyway (fairseq's ``buffered_future_mask``); any other mask is refused, never dropped."""
        if attn_mask is None:
            return None
        if self.causal and not decoding and is_future_mask(attn_mask, t, s):
            return None
        if self.takes_attn_mask and not decoding:
            return attn_mask
        takers = ", ".join(name for name, cls in ATTENTION_CLASSES.items() if cls.takes_attn_mask)
        takes = "the standard causal (future) mask only (none while decoding)" if self.causal else "no attn_mask"
        raise ValueError(
            f"{'causal ' if self.causal else ''}{self.method} attention takes {takes}; got {'another' if self.causal else 'a'} "
            f"{tuple(attn_mask.shape)} attn_mask{' while decoding' if decoding else ''}. An arbitrary attn_mask is "
            f"taken by: {takers} (--encoder-attention-type / --decoder-attention-type)")

    def attend(self, q: Tensor, k: Optional[Tensor], v: Tensor, key_padding_mask: Optional[Tensor],
               attn_mask: Optional[Tensor] = None) -> Tensor:
        """Full-sequence attention on (B, H, N, D) tensors (``attn_mask`` only where ``takes_attn_mask``)."""
        raise NotImplementedError

    def source_state(self, v: Tensor, key_padding_mask: Optional[Tensor]) -> State:
        """What a source-caching cross-attention keeps of its source values (B, H, S, D) while decoding."""
        raise NotImplementedError

    def attend_source(self, q: Tensor, state: State) -> Tensor:
        """Cross-attention of queries (B, H, T, D) to the source kept by ``source_state``."""
        raise NotImplementedError

    def attention_weights(self, q: Tensor, k: Optional[Tensor], key_padding_mask: Optional[Tensor],
                          attn_mask: Optional[Tensor] = None) -> Optional[Tensor]:
        """The (B, H, T, S) attention matrix for ``need_weights``; None for methods that never form it
        (``attention_rows`` materialises theirs for analysis)."""
        return None

    def step(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], state: State):
        """One decoding step: (B, H, 1, D) tensors and the buffered state -> (out, new state)."""
        raise NotImplementedError(f"{self.method} attention has no incremental decoding")

    # -- analysis: the module describes its own attention (docs/design.md §8) ----------------------
    def attention_rows(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, rows=None,
                       lln: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """Rows of the module's row-stochastic attention matrix P (B, H, R, N) from its projected q, k (B, H, N, D).

        ``rows``: None (all), an int (that many evenly spaced rows) or a LongTensor of indices
        (``ops.select_rows``).
        ``lln``: alpha, beta (shape (G,)) for LLN modules, e.g. the matcher's ``last_alpha`` / ``last_beta``
        of the forward being analysed (default: ``lln_parameters(q, k, key_padding_mask)``); others ignore it.
        Float32 for half inputs; a query with no visible key gets a row of zeros. What P is: the subclass's
        docstring and its registry entry's ``rows_note``. No state of the module changes.
        """
        raise NotImplementedError(f"{self.method} attention has no attention rows")

    def reference(self, q: Tensor, k: Optional[Tensor], v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """What ``attend`` computes, materialised by the op's ``*_reference`` (the paper's formula, N×N), in the
        inputs' dtype: run it on a float64 copy of the module to check ``attend`` (tests, GPU self-test)."""
        raise NotImplementedError(f"{self.method} attention has no reference")

    def lln_parameters(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None
                       ) -> Optional[Dict[str, Tensor]]:
        """alpha, beta, sigma_q, sigma_k, tau (shape (G,)) of an LLN module for q, k; None for other methods."""
        return None

    def kernel_rows(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, rows=None) -> Tensor:
        """Rows of a kernel method's unnormalised C (B, H, R, N), out = C V (where ``is_kernel_method``)."""
        raise NotImplementedError(f"{self.method} attention is not a kernel method")

    # -- loading a softmax checkpoint ("linearization": attention swap, then fine-tune) ----------
    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> None:
        """Fill this method's own parameters/buffers missing from ``state_dict`` with their init values.

        A stock fairseq MultiheadAttention checkpoint has only q/k/v/out_proj: loading it into any of
        our methods (``--finetune-from-model``, ``--restore-file``) keeps those and starts LAVO's bases
        and bias, LLN+Diag's mix weights and LLN's EMA statistics fresh. fairseq calls this before its
        strict ``load_state_dict``.
        """
        prefix = name + "." if name else ""
        own = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        if not any(key.startswith(prefix + "q_proj.") for key in state_dict):
            return  # this module is not in the checkpoint at all (e.g. a head added later)
        for key, value in own.items():
            if not key.split(".")[0].endswith("_proj") and prefix + key not in state_dict:
                logger.info("%s%s is not in the checkpoint: starting it from its initial value", prefix, key)
                state_dict[prefix + key] = value.detach().clone()

    # -- fairseq's incremental-state contract ---------------------------------------------------
    def _get_input_buffer(self, incremental_state) -> State:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: State):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search: every buffered tensor has the batch (times beam) on dim 0."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer:
            buffer = {name: (t.index_select(0, new_order) if t is not None else None) for name, t in buffer.items()}
            incremental_state = self._set_input_buffer(incremental_state, buffer)
        return incremental_state


def is_future_mask(attn_mask: Tensor, t: int, s: int) -> bool:
    """True if ``attn_mask`` is fairseq's (T, T) future mask: -inf (or True) above the diagonal, 0 (False) on
    and below it. O(T²) like the mask itself; fairseq_linattn's own decoders pass none."""
    if tuple(attn_mask.shape) != (t, s) or t != s:
        return False
    future = torch.ones(t, t, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return bool(torch.equal(attn_mask, future))
    if not attn_mask.is_floating_point():
        return False
    return bool(torch.equal(torch.isneginf(attn_mask), future) and (attn_mask.masked_fill(future, 0) == 0).all())


class SoftmaxAttention(AttentionBase):
    """Exact scaled-dot-product attention; equals fairseq's MultiheadAttention with the same weights."""

    method = "softmax"
    takes_attn_mask = True

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        p = self.dropout if self.training else 0.0
        return ops.softmax_attention(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask,
                                     attn_mask=attn_mask, dropout_p=p)

    def attention_weights(self, q, k, key_padding_mask, attn_mask=None):
        return ops.softmax_attention_weights(q, k, causal=self.causal, key_padding_mask=key_padding_mask,
                                             attn_mask=attn_mask)

    def step(self, q, k, v, key_padding_mask, state):
        if "prev_key" in state:
            k, v = torch.cat([state["prev_key"], k], 2), torch.cat([state["prev_value"], v], 2)
        b, s = k.shape[0], k.shape[2]
        mask = key_padding_mask if key_padding_mask is not None else torch.zeros(b, 1, dtype=torch.bool,
                                                                                     device=k.device)
        if "prev_key_padding_mask" in state:
            mask = torch.cat([state["prev_key_padding_mask"], mask], 1)
        out = ops.softmax_attention(q, k, v, key_padding_mask=mask if mask.any() else None)
        return out, {"prev_key": k, "prev_value": v, "prev_key_padding_mask": mask}

    def reference(self, q, k, v, key_padding_mask=None):
        return ops.softmax_attention_reference(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """softmax(q k^T / sqrt(D)) with the causal and padding masks (Vaswani et al. eq. 1). Exact: P V = output."""
        ct = compute_dtype(q)
        return ops.softmax_attention_weights(q.to(ct), k.to(ct), causal=self.causal, rows=rows,
                                             key_padding_mask=check_key_padding_mask(key_padding_mask, k))


class LLNAttention(AttentionBase):
    """Linear Log-Normal attention (LLN eq. 8-9) with the moment-matching hook (docs/design.md §3.1)."""

    method = "lln"

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        c = self.config
        self.chunk_size = c.lln_chunk_size
        self.matcher = MomentMatcher(
            mode=c.moment_matching, head_dim=self.head_dim, num_heads=num_heads, per_head=c.lln_stats_per_head,
            stats=("ema" if self.causal else "batch") if c.lln_stats == "auto" else c.lln_stats,
            ema_momentum=c.lln_ema_momentum, max_scale=c.lln_max_scale, fixed_alpha=c.lln_alpha,
            fixed_beta=c.lln_beta, constants_file=c.lln_constants_file)

    def lln(self, q, k, v, key_padding_mask):
        alpha, beta = self.matcher(q, k, key_padding_mask)
        return ops.lln_attention(q, k, v, alpha, beta, causal=self.causal, key_padding_mask=key_padding_mask,
                                 chunk_size=self.chunk_size)

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        return self.lln(q, k, v, key_padding_mask)

    def lln_step(self, q, k, v, key_padding_mask, state):
        if "lln_s" not in state:
            s, shift = lln_decode_init(q.shape[0], self.num_heads, self.head_dim, v.shape[-1],
                                       dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                                       device=q.device)
        else:
            s, shift = state["lln_s"], state["lln_shift"]
        alpha, beta = self.matcher.current(q)  # decoding uses the frozen (EMA) statistics
        out, s, shift = lln_decode_step(q, k, v, alpha, beta, s, shift, key_padding_mask=key_padding_mask)
        return out, {**state, "lln_s": s, "lln_shift": shift}

    def step(self, q, k, v, key_padding_mask, state):
        return self.lln_step(q, k, v, key_padding_mask, state)

    @torch.no_grad()
    def lln_parameters(self, q, k, key_padding_mask=None):
        """alpha, beta (shape (G,), G = H per head or 1 per layer) that the next forward on q, k would use,
        with sigma_q, sigma_k and tau (LLN eq. 11); float64.

        The matcher runs in eval mode, so its EMA buffers are not updated (an EMA forward in training
        also uses the buffers from before its batch, so the values are the same); the matcher's
        ``last_*`` logging values are restored afterwards. Batch statistics are not all-reduced.
        """
        names = ("last_sigma_q", "last_sigma_k", "last_alpha", "last_beta", "last_tau")
        saved, was_training = {n: getattr(self.matcher, n) for n in names}, self.matcher.training
        self.matcher.train(False)
        try:
            self.matcher(q, k, key_padding_mask)
            return {n[len("last_"):]: getattr(self.matcher, n) for n in names}
        finally:
            self.matcher.train(was_training)
            for n, value in saved.items():
                setattr(self.matcher, n, value)

    def _alpha_beta(self, q, k, key_padding_mask, lln):
        """(alpha, beta) as (1, G, 1, 1) tensors from ``lln`` or, if None, ``lln_parameters``."""
        lln = self.lln_parameters(q, k, key_padding_mask) if lln is None else lln
        return (torch.as_tensor(lln[name]).reshape(1, -1, 1, 1) for name in ("alpha", "beta"))

    def reference(self, q, k, v, key_padding_mask=None):
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, None)
        return ops.lln_attention_reference(q, k, v, alpha.to(q), beta.to(q), causal=self.causal,
                                           key_padding_mask=key_padding_mask)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """The LLN matrix (LLN eq. 8-9) with the module's alpha, beta. Exact: P V = output."""
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, lln)
        return ops.lln_attention_weights(q, k, alpha, beta, causal=self.causal, key_padding_mask=key_padding_mask,
                                         rows=rows)


class LLNDiagAttention(LLNAttention):
    """LLN+Diag (LLN §4.2): LLN mixed with softmax inside diagonal blocks."""

    method = "lln_diag"

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        self.block_size, self.mix = self.config.lln_diag_block_size, self.config.lln_diag_mix
        shape = (num_heads, self.head_dim)
        self.mix_r = nn.Parameter(torch.full(shape, 0.5)) if self.mix != "average" else None
        self.mix_p = nn.Parameter(torch.full(shape, 0.5)) if self.mix == "learnable_scale" else None

    @over_real_tokens
    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        lln = self.lln(q, k, v, key_padding_mask)
        diag = ops.block_softmax_attention(q, k, v, block_size=self.block_size, causal=self.causal,
                                           key_padding_mask=key_padding_mask)
        return mix_lln_diag(lln, diag, self.mix, self.mix_r, self.mix_p)

    def step(self, q, k, v, key_padding_mask, state):
        """Softmax over the keys of the token's block, counted over the row's real tokens (as ``attend``): the
        buffer keeps the keys, values, padding and block index of the tokens a later token may still read."""
        b = q.shape[0]
        pad = torch.zeros(b, 1, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        pos = state.get("position")
        pos = torch.zeros(b, dtype=torch.long, device=q.device) if pos is None else pos  # real tokens so far
        lln, state = self.lln_step(q, k, v, key_padding_mask, state)
        block = (pos // self.block_size)[:, None]  # (B, 1): this token's block (LLN §4.2)
        bk, bv, bpad, bid = k, v, pad, block
        if "block_key" in state:
            bk, bv = torch.cat([state["block_key"], k], 2), torch.cat([state["block_value"], v], 2)
            bpad, bid = torch.cat([state["block_key_padding_mask"], pad], 1), torch.cat([state["block_id"], block], 1)
        diag = ops.softmax_attention(q, bk, bv, key_padding_mask=bpad | (bid != block))
        out = mix_lln_diag(lln, diag, self.mix, self.mix_r, self.mix_p)
        pos = pos + (~pad[:, 0]).long()
        alive = ~bpad & (bid == (pos // self.block_size)[:, None])  # keys the row's next token can read
        first = int(alive.any(0).long().argmax()) if bool(alive.any()) else bk.shape[2]  # older ones: no row's
        return out, {**state, "block_key": bk[:, :, first:], "block_value": bv[:, :, first:],
                     "block_key_padding_mask": bpad[:, first:], "block_id": bid[:, first:], "position": pos}

    @over_real_tokens
    def reference(self, q, k, v, key_padding_mask=None):
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, None)
        return ops.lln_diag_attention_reference(q, k, v, alpha.to(q), beta.to(q), block_size=self.block_size,
                                                causal=self.causal, key_padding_mask=key_padding_mask, mix=self.mix,
                                                r=self.mix_r, p=self.mix_p)

    @torch.no_grad()
    @rows_over_real_tokens
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """``ops.lln_diag_attention_weights`` (LLN §4.2): 0.5 P_lln + 0.5 P_diag for mix ``average``, exact;
        the head's mean mix weights for the learnable mixes (exact when constant over a head's channels)."""
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, lln)
        return ops.lln_diag_attention_weights(q, k, alpha, beta, block_size=self.block_size, causal=self.causal,
                                              key_padding_mask=key_padding_mask, mix=self.mix, r=self.mix_r,
                                              p=self.mix_p, rows=rows)


class KernelizedAttention(AttentionBase):
    """Exact Gaussian-kernel attention (Skyformer §4.1); non-causal, quadratic."""

    method = "kernelized"
    is_kernel_method = True

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        return ops.kernelized_attention(q, k, v, key_padding_mask=key_padding_mask)

    def reference(self, q, k, v, key_padding_mask=None):
        return ops.kernelized_attention_reference(q, k, v, key_padding_mask=key_padding_mask)

    @torch.no_grad()
    def kernel_rows(self, q, k, key_padding_mask=None, rows=None):
        """Rows of the exact Gaussian kernel C (B, H, R, N) of ``attend``: out = C V (Skyformer §4.1)."""
        return ops.kernelized_kernel_matrix(q, k, key_padding_mask=key_padding_mask, rows=rows)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """``kernel_rows`` normalised to sum 1 (``ops.kernel_attention_weights``): out = (C 1) * (P V)."""
        return ops.kernel_attention_weights(self.kernel_rows(q, k, key_padding_mask, rows))


class SkyformerAttention(AttentionBase):
    """Skyformer (Nyström-approximated Gaussian-kernel attention, §4.2); non-causal."""

    method = "skyformer"
    is_kernel_method = True

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        c = self.config
        self.num_landmarks, self.landmark_mode = c.skyformer_landmarks, c.skyformer_landmark_mode
        self.exact_inverse = c.skyformer_exact_inverse

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        return ops.skyformer_attention(q, k, v, num_landmarks=self.num_landmarks, key_padding_mask=key_padding_mask,
                                       mode=self.landmark_mode, exact_inverse=self.exact_inverse,
                                       training=self.training)

    def reference(self, q, k, v, key_padding_mask=None):
        """The materialised Nyström kernel C_Q M^-1 C_K^T (Skyformer §4.2, eval landmarks) times v: ``attend`` in
        eval mode (the exact kernel it approximates is Kernelized's reference)."""
        return ops.skyformer_kernel_matrix(q, k, num_landmarks=self.num_landmarks, key_padding_mask=key_padding_mask,
                                           mode=self.landmark_mode, exact_inverse=self.exact_inverse,
                                           training=False).to(v.dtype) @ v

    @torch.no_grad()
    def kernel_rows(self, q, k, key_padding_mask=None, rows=None):
        """Rows of the Nyström kernel C_Q M^-1 C_K^T (B, H, R, N) (Skyformer §4.2) with the deterministic
        eval landmarks (``training=False``): out = C V in eval mode."""
        return ops.skyformer_kernel_matrix(q, k, num_landmarks=self.num_landmarks, key_padding_mask=key_padding_mask,
                                           mode=self.landmark_mode, exact_inverse=self.exact_inverse,
                                           training=False, rows=rows)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """``kernel_rows`` with negatives (from the approximate inverse) set to 0, normalised to sum 1
        (``ops.kernel_attention_weights``): out = (C 1) * (P V) where C >= 0."""
        return ops.kernel_attention_weights(self.kernel_rows(q, k, key_padding_mask, rows))


class LAVOAttention(AttentionBase):
    """LAVO (orthogonal memory + context dissection + relative bias, LAVO §3); self- or cross-attention."""

    method = "lavo"

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        self.window, cross = self.config.lavo_window, self.cross
        r = self.config.lavo_bases or self.head_dim
        if r > self.head_dim:
            raise ValueError(f"--lavo-bases must be <= head dim {self.head_dim}, got {r}")
        self.uses_keys, self.caches_source = not cross, cross  # cross-attention reads source values only (§3.4)
        if cross:  # kept so that softmax checkpoints load, frozen: DDP fails on a parameter without gradient
            self.k_proj.requires_grad_(False)
        self.bases = nn.Parameter(ops.lavo_init_bases(num_heads, r, self.head_dim),
                                  requires_grad=not self.config.lavo_freeze_bases)
        self.pos_bias = None if cross else nn.Parameter(torch.zeros(num_heads, 2 * self.window - 1))

    @over_real_tokens
    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        if self.cross:
            return self.attend_source(q, self.source_state(v, key_padding_mask))
        return ops.lavo_attention(q, k, v, self.bases, self.pos_bias, window=self.window, causal=self.causal,
                                  key_padding_mask=key_padding_mask)

    def source_state(self, v, key_padding_mask):
        """The source memory (LAVO eq. 3): mean (B, H, r) of B v_j over real source tokens, and their count (B,)."""
        mean, count = ops.lavo_cross_memory(v, self.bases, key_padding_mask=key_padding_mask)
        return {"source_memory": mean, "source_count": count}

    def attend_source(self, q, state):
        return ops.lavo_cross_readout(q, state["source_memory"], state["source_count"], self.bases)

    def step(self, q, k, v, key_padding_mask, state):
        if not state:
            state = ops.lavo_init_state(q.shape[0], self.num_heads, self.head_dim, self.bases.shape[1],
                                        window=self.window, dtype=q.dtype, device=q.device)
        return ops.lavo_decode_step(q, k, v, self.bases, self.pos_bias, state, window=self.window,
                                    key_padding_mask=key_padding_mask)

    @over_real_tokens
    def reference(self, q, k, v, key_padding_mask=None):
        if self.cross:
            return ops.lavo_cross_attention_reference(q, v, v, self.bases.to(q), key_padding_mask=key_padding_mask)
        return ops.lavo_attention_reference(q, k, v, self.bases.to(q), self.pos_bias.to(q), window=self.window,
                                            causal=self.causal, key_padding_mask=key_padding_mask)

    @torch.no_grad()
    @rows_over_real_tokens
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """Self-attention's token mixing P_t = 0.5 (A_t + m_t) (``ops.lavo_token_mixing``, LAVO eq. 3): exact over
        tokens, but P V is not the output, whose memory read-out also projects the values per query."""
        if self.cross:
            raise ValueError("LAVO cross-attention has no token-level attention matrix (every query reads the "
                             "mean of the source); analyse self-attention modules")
        return ops.lavo_attention_weights(q, k, self.pos_bias, window=self.window, causal=self.causal,
                                          key_padding_mask=key_padding_mask, rows=rows)


ATTENTION_CLASSES = {name: globals()[method.module_class] for name, method in METHODS.items()}


def build_attention(method: str, embed_dim: int, num_heads: int, *, causal: bool, dropout: float = 0.0,
                    config: Union[None, AttentionConfig, Mapping] = None, cross: bool = False, **kw) -> AttentionBase:
    """The module for ``method`` as self-attention (``causal`` or not) or ``cross``-attention.

    ``config``: the plugin's options (an ``AttentionConfig``, or a mapping of option names to values for
    the others' defaults, validated here); ``kw``: kdim, vdim, bias.
    """
    role = "cross" if cross else "decoder" if causal else "encoder"
    if method not in METHODS or role not in METHODS[method].roles:
        why = " (a non-causal method)" if role == "decoder" and method in METHODS else ""
        raise ValueError(f"{role} attention type must be one of {', '.join(methods_for(role))}, got {method!r}{why}")
    if not isinstance(config, AttentionConfig):
        config = AttentionConfig(**(config or {}))
        config.validate()
    return ATTENTION_CLASSES[method](embed_dim, num_heads, causal=causal, cross=cross, dropout=dropout, config=config,
                                     **kw)

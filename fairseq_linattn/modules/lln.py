"""LLN attention's module (LLN eq. 8-9) with its moment matcher."""
import torch

from linattn import ops
from linattn.ops import lln_decode_init, lln_decode_step

from .base import AttentionBase
from .moment_matcher import LAST, MomentMatcher
from .registry import register_attention


@register_attention("lln")
class LLNAttention(AttentionBase):
    """Linear Log-Normal attention (LLN eq. 8-9) with the moment-matching hook (docs/design.md §3.1)."""

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        c = self.config
        self.chunk_size = c.lln_chunk_size
        self.matcher = MomentMatcher(
            mode=c.moment_matching, head_dim=self.head_dim, num_heads=num_heads, per_head=c.lln_stats_per_head,
            stats=("ema" if self.causal else "batch") if c.lln_stats == "auto" else c.lln_stats,
            ema_momentum=c.lln_ema_momentum, max_scale=c.lln_max_scale, fixed_alpha=c.lln_alpha,
            fixed_beta=c.lln_beta, constants_file=c.lln_constants_file, impl=c.attention_impl)

    @classmethod
    def impl_options(cls, config, params):
        return {"chunk": config.lln_chunk_size}

    def lln(self, q, k, v, key_padding_mask):
        alpha, beta = self.matcher(q, k, key_padding_mask)
        return ops.lln_attention(q, k, v, alpha, beta, causal=self.causal, key_padding_mask=key_padding_mask,
                                 chunk_size=self.chunk_size, impl=self.config.attention_impl)

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
        """alpha, beta (shape (G,), G = H per head or 1 per layer; (B, G) for per-sequence statistics) that
        the next forward on q, k would use, with sigma_q, sigma_k and tau (LLN eq. 11); float64.

        The matcher peeks: no buffer is updated and batch statistics are not all-reduced; its ``last_*``
        logging values are restored afterwards.
        """
        saved = {n: getattr(self.matcher, n) for n in LAST}
        try:
            self.matcher(q, k, key_padding_mask, peek=True)
            return {n[len("last_"):]: getattr(self.matcher, n) for n in LAST}
        finally:
            for n, value in saved.items():
                setattr(self.matcher, n, value)

    def _alpha_beta(self, q, k, key_padding_mask, lln):
        """(alpha, beta) as (1, G, 1, 1) (or (B, G, 1, 1)) tensors from ``lln`` or, if None, ``lln_parameters``."""
        lln = self.lln_parameters(q, k, key_padding_mask) if lln is None else lln
        values = [torch.as_tensor(lln[name]) for name in ("alpha", "beta")]
        return (x.reshape(x.shape[0] if x.dim() == 2 else 1, -1, 1, 1) for x in values)

    def reference(self, q, k, v, key_padding_mask=None):
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, None)
        return ops.lln_attention_reference(q, k, v, alpha.to(q), beta.to(q), causal=self.causal,
                                           key_padding_mask=key_padding_mask)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """The LLN matrix (B, H, R, N) (LLN eq. 8-9) with ``lln``, LLN's alpha, beta for this forward
        (default: the module's, ``lln_parameters``). Exact: P V = output."""
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, lln)
        return ops.lln_attention_weights(q, k, alpha, beta, causal=self.causal, key_padding_mask=key_padding_mask,
                                         rows=rows)

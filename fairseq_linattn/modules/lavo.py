"""LAVO's module (orthogonal memory, context dissection, relative bias; LAVO §3)."""
import torch
from torch import nn

from linattn import ops

from .base import AttentionBase
from .padding import over_real_tokens, rows_over_real_tokens
from .registry import register_attention


@register_attention("lavo")
class LAVOAttention(AttentionBase):
    """LAVO (orthogonal memory + context dissection + relative bias, LAVO §3); self- or cross-attention."""

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

    @classmethod
    def impl_options(cls, config, params):
        return {"window": config.lavo_window, "bases_dtype": params}

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        if self.cross:
            return self.attend_source(q, self.source_state(v, key_padding_mask))
        # windows count each row's real tokens, padding anywhere (the fused kernels read the rows in that order)
        return ops.lavo_attention(q, k, v, self.bases, self.pos_bias, window=self.window, causal=self.causal,
                                  key_padding_mask=key_padding_mask, impl=self.config.attention_impl, real_first=True)

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

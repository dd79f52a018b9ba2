"""LLN+Diag's module (LLN §4.2): LLN mixed with softmax inside diagonal blocks."""
import torch
from torch import nn

from linattn import ops
from linattn.ops import mix_lln_diag

from .lln import LLNAttention
from .registry import register_attention


@register_attention("lln_diag")
class LLNDiagAttention(LLNAttention):
    """LLN+Diag (LLN §4.2): LLN mixed with softmax inside diagonal blocks."""

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        self.block_size, self.mix = self.config.lln_diag_block_size, self.config.lln_diag_mix
        shape = (num_heads, self.head_dim)
        self.mix_r = nn.Parameter(torch.full(shape, 0.5)) if self.mix != "average" else None
        self.mix_p = nn.Parameter(torch.full(shape, 0.5)) if self.mix == "learnable_scale" else None

    @classmethod
    def impl_options(cls, config, params):
        return {**super().impl_options(config, params), "block": config.lln_diag_block_size}

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        """One op: ``average`` fuses both parts (one output, one set of gradients), the learnable mixes mix them.
        Its blocks count each row's real tokens, padding anywhere (``linattn.ops.real_tokens``)."""
        alpha, beta = self.matcher(q, k, key_padding_mask)
        return ops.lln_diag_attention(q, k, v, alpha, beta, block_size=self.block_size, causal=self.causal,
                                      key_padding_mask=key_padding_mask, chunk_size=self.chunk_size, mix=self.mix,
                                      r=self.mix_r, p=self.mix_p, impl=self.config.attention_impl)

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

    def reference(self, q, k, v, key_padding_mask=None):
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, None)
        return ops.lln_diag_attention_reference(q, k, v, alpha.to(q), beta.to(q), block_size=self.block_size,
                                                causal=self.causal, key_padding_mask=key_padding_mask, mix=self.mix,
                                                r=self.mix_r, p=self.mix_p)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """``ops.lln_diag_attention_weights`` (LLN §4.2): 0.5 P_lln + 0.5 P_diag for mix ``average``, exact;
        the head's mean mix weights for the learnable mixes (exact when constant over a head's channels)."""
        alpha, beta = self._alpha_beta(q, k, key_padding_mask, lln)
        return ops.lln_diag_attention_weights(q, k, alpha, beta, block_size=self.block_size, causal=self.causal,
                                              key_padding_mask=key_padding_mask, mix=self.mix, r=self.mix_r,
                                              p=self.mix_p, rows=rows)

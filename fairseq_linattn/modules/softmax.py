"""Softmax attention's module (exact; fairseq's MultiheadAttention with the same weights)."""
import torch

from linattn import ops
from linattn.ops import check_key_padding_mask, compute_dtype

from .base import AttentionBase
from .registry import register_attention


@register_attention("softmax")
class SoftmaxAttention(AttentionBase):
    """Exact scaled-dot-product attention; equals fairseq's MultiheadAttention with the same weights."""

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
        b = k.shape[0]
        mask = key_padding_mask if key_padding_mask is not None else torch.zeros(b, 1, dtype=torch.bool,
                                                                                     device=k.device)
        if "prev_key_padding_mask" in state:
            mask = torch.cat([state["prev_key_padding_mask"], mask], 1)
        out = ops.softmax_attention(q, k, v, key_padding_mask=mask)
        return out, {"prev_key": k, "prev_value": v, "prev_key_padding_mask": mask}

    def reference(self, q, k, v, key_padding_mask=None):
        return ops.softmax_attention_reference(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask)

    @torch.no_grad()
    def attention_rows(self, q, k, key_padding_mask=None, rows=None, lln=None):
        """softmax(q k^T / sqrt(D)) with the causal and padding masks (Vaswani et al. eq. 1). Exact: P V = output."""
        ct = compute_dtype(q)
        return ops.softmax_attention_weights(q.to(ct), k.to(ct), causal=self.causal, rows=rows,
                                             key_padding_mask=check_key_padding_mask(key_padding_mask, k))

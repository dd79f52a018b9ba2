"""Skyformer's module (Nyström-approximated Gaussian kernel, Skyformer §4.2)."""
import torch

from linattn import ops

from .base import AttentionBase
from .registry import register_attention


@register_attention("skyformer")
class SkyformerAttention(AttentionBase):
    """Skyformer (Nyström-approximated Gaussian-kernel attention, §4.2); non-causal."""

    is_kernel_method = True

    def __init__(self, embed_dim, num_heads, **kw):
        super().__init__(embed_dim, num_heads, **kw)
        c = self.config
        self.num_landmarks, self.landmark_mode = c.skyformer_landmarks, c.skyformer_landmark_mode
        self.exact_inverse = c.skyformer_exact_inverse

    @classmethod
    def impl_options(cls, config, params):
        return {"num_landmarks": config.skyformer_landmarks}

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        return ops.skyformer_attention(q, k, v, num_landmarks=self.num_landmarks, key_padding_mask=key_padding_mask,
                                       mode=self.landmark_mode, exact_inverse=self.exact_inverse,
                                       training=self.training, impl=self.config.attention_impl)

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

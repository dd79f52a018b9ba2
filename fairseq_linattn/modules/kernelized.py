"""Kernelized attention's module (exact Gaussian kernel, Skyformer §4.1)."""
import torch

from linattn import ops

from .base import AttentionBase
from .registry import register_attention


@register_attention("kernelized")
class KernelizedAttention(AttentionBase):
    """Exact Gaussian-kernel attention (Skyformer §4.1); non-causal, quadratic."""

    is_kernel_method = True

    def attend(self, q, k, v, key_padding_mask, attn_mask=None):
        return ops.kernelized_attention(q, k, v, key_padding_mask=key_padding_mask,
                                        impl=self.config.attention_impl)

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

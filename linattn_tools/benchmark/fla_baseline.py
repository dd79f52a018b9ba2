"""A baseline series of the targets benchmark (``targets``): flash-linear-attention's chunked causal linear attention
(the ``fla-core`` package's ``fla.ops.linear_attn.chunk_linear_attn``: Triton kernels in the chunk form of Yang et
al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training", §3) in the softmax module's
projections and layout, so that its step and ours differ only by the attention. Its features are elu + 1
(Katharopoulos et al. 2020, eq. 7), the output normalised by their sums: out_i = f(q_i) S_i / (f(q_i) · z_i), with
S_i = Σ_{j<=i} f(k_j)ᵀ v_j and z_i = Σ_{j<=i} f(k_j) (their eq. 9, causal). fla runs on GPUs only (its kernels
need a Triton driver); where it does not import, the series is left out and the reason recorded."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_linattn.modules.softmax import SoftmaxAttention

METHOD = "fla_linear"  # the series' name in the targets' rows
IMPL = "fla-core"  # its rows' implementation


def unavailable(device) -> Optional[str]:
    """None where fla's chunk linear attention runs (``device`` a CUDA device and fla imports), else why not."""
    if torch.device(device).type != "cuda":
        return f"fla-core's kernels run on CUDA GPUs only, not on {device}"
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401
    except Exception as e:  # an ImportError, or a Triton that finds no driver at import
        return f"fla-core's chunk_linear_attn does not import here ({type(e).__name__}: {e})"
    return None


def fla_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("fla-core")
    except PackageNotFoundError:
        return "unknown"


class FlaLinearAttention(SoftmaxAttention):
    """The softmax module (the same q, k, v and output projections) with its attention replaced by fla's causal
    normalised linear attention; training steps only (no decoding, no padding mask: the targets' causal steps are
    unpadded)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask, attn_mask=None) -> Tensor:
        """q, k (B, H, N, D), v (B, H, N, Dv) -> (B, H, N, Dv)."""
        from fla.ops.linear_attn import chunk_linear_attn
        if not self.causal or key_padding_mask is not None or attn_mask is not None:
            raise ValueError(f"{METHOD}: the baseline is causal self-attention without a padding mask or attn_mask")
        fq, fk = F.elu(q) + 1, F.elu(k) + 1  # Katharopoulos et al. 2020, eq. 7
        out, _ = chunk_linear_attn(fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                   normalize=True)  # fla's layout (B, N, H, D); scale 1: the features' own sums
        return out.transpose(1, 2)


def build_baseline(embed_dim: int = 768, num_heads: int = 12, dtype=None, device=None) -> FlaLinearAttention:
    """The baseline module in training mode, in ``dtype`` on ``device``."""
    from linattn.config import AttentionConfig
    return FlaLinearAttention(embed_dim, num_heads, causal=True, cross=False, dropout=0.0,
                              config=AttentionConfig()).to(device=device, dtype=dtype).train()

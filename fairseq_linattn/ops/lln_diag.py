"""LLN+Diag (LLN §4.2, Fig. 3): LLN over the whole sequence mixed with block-diagonal softmax."""
from typing import Optional

from torch import Tensor

from .block_softmax import block_softmax_attention, block_softmax_attention_reference
from .lln import lln_attention, lln_attention_reference

MIX_MODES = ("average", "learnable_scale", "learnable_ratio")


def mix_lln_diag(lln_out: Tensor, diag_out: Tensor, mix: str = "average", r: Optional[Tensor] = None,
                 p: Optional[Tensor] = None) -> Tensor:
    """average: (LLN + Diag)/2; learnable_scale: r*LLN + p*Diag; learnable_ratio: r*LLN + (1-r)*Diag.

    r, p are (H, Dv) (per head and channel), broadcast over batch and tokens.
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    if mix == "average":
        return 0.5 * (lln_out + diag_out)
    h, dv = lln_out.shape[1], lln_out.shape[-1]
    needed = {"learnable_scale": ("r", "p"), "learnable_ratio": ("r",)}[mix]
    for name, t in (("r", r), ("p", p)):
        if name in needed and (t is None or tuple(t.shape) != (h, dv)):
            raise ValueError(f"mix={mix!r} needs {name} of shape (H, Dv) = {(h, dv)}, "
                             f"got {None if t is None else tuple(t.shape)}")
    r4 = r[None, :, None, :].to(lln_out.dtype)
    if mix == "learnable_scale":
        return r4 * lln_out + p[None, :, None, :].to(lln_out.dtype) * diag_out
    return r4 * lln_out + (1 - r4) * diag_out


def lln_diag_attention(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                       causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                       chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                       p: Optional[Tensor] = None) -> Tensor:
    """q, k (B,H,N,D), v (B,H,N,Dv) -> (B,H,N,Dv); linear in N for a fixed block_size."""
    lln = lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                        chunk_size=chunk_size)
    diag = block_softmax_attention(q, k, v, block_size=block_size, causal=causal,
                                   key_padding_mask=key_padding_mask)
    return mix_lln_diag(lln, diag, mix, r, p)


def lln_diag_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, block_size: int = 64,
                                 causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                                 chunk_size: int = 64, mix: str = "average", r: Optional[Tensor] = None,
                                 p: Optional[Tensor] = None) -> Tensor:
    """Both parts materialised as N×N matrices."""
    lln = lln_attention_reference(q, k, v, alpha, beta, causal=causal, key_padding_mask=key_padding_mask,
                                  chunk_size=chunk_size)
    diag = block_softmax_attention_reference(q, k, v, block_size=block_size, causal=causal,
                                             key_padding_mask=key_padding_mask)
    return mix_lln_diag(lln, diag, mix, r, p)

"""LAVO cross-attention (LAVO §3.4) in two steps: the source memory (B,H,r) once, then any query (B,H,N,D).

Cross-attention = ``lavo_cross_readout(q, *lavo_cross_memory(v_src, bases, key_padding_mask=...), bases)``;
it uses the source values only.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_qkv
from ..precision import autocast_off, compute_dtype
from .inputs import check_bases
from .memory import memory_readout


@autocast_off
def lavo_cross_memory(v_src: Tensor, bases: Tensor, *, key_padding_mask: Optional[Tensor] = None
                      ) -> Tuple[Tensor, Tensor]:
    """The source memory of LAVO cross-attention: H = mean_j (B v_j) over non-padded j (LAVO eq. 3).

    v_src (B,H,S,D), bases (H,r,D) -> (mean (B,H,r), count (B,)) in the compute dtype (fp32 for half
    inputs). All a decoder needs of the source: ``lavo_cross_readout`` answers any query from it. O(S r D).
    """
    check_qkv(v_src, v_src, v_src)
    check_bases(bases, v_src.shape[1], v_src.shape[-1])
    key_padding_mask = check_key_padding_mask(key_padding_mask, v_src)
    ct = compute_dtype(v_src)
    tok = torch.ones(v_src.shape[0], v_src.shape[2], dtype=ct, device=v_src.device)
    if key_padding_mask is not None:
        tok = (~key_padding_mask).to(ct)
    cnt = tok.sum(1)
    bv = torch.einsum("bhsd,hrd->bhsr", v_src.to(ct), bases.to(ct)) * tok[:, None, :, None]
    return bv.sum(2) / cnt.clamp_min(1)[:, None, None], cnt


@autocast_off
def lavo_cross_readout(q: Tensor, mean: Tensor, count: Tensor, bases: Tensor) -> Tensor:
    """softmax(Q Xtil^T/sqrt(D)) Xtil with Xtil = B ⊙ mean (LAVO eq. 4): q (B,H,N,D) -> (B,H,N,D).

    ``mean``, ``count`` from ``lavo_cross_memory``; a row with no source token (count 0) gives 0. O(N r D).
    """
    b, h, _, d = q.shape
    check_bases(bases, h, d)
    if tuple(mean.shape) != (b, h, bases.shape[1]) or tuple(count.shape) != (b,):
        raise ValueError(f"mean and count must have shapes (B, H, r) = {(b, h, bases.shape[1])} and (B,) = {(b,)} "
                         f"(from lavo_cross_memory), got {tuple(mean.shape)} and {tuple(count.shape)}")
    ct = mean.dtype
    qb = torch.einsum("bhnd,hrd->bhnr", q.to(ct), bases.to(ct))
    out = memory_readout(qb, mean[:, :, None, :], bases.to(ct), 1.0 / math.sqrt(d))
    return (out * (count > 0).to(ct)[:, None, None, None]).to(q.dtype)

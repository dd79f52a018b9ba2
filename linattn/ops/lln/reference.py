"""Materialised LLN (LLN eq. 8-9): rows P (B,H,R,S) in float64 features, and P V."""
from typing import Optional

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_scale, check_qkv
from ..masking import Rows, allowed_keys, masked_softmax, select_rows
from ..precision import compute_dtype


def lln_attention_weights(q: Tensor, k: Tensor, alpha, beta, *, causal: bool = False,
                          key_padding_mask: Optional[Tensor] = None, rows: Rows = None) -> Tensor:
    """Rows of the LLN matrix P_ij = exp(alpha q_i)·exp(beta k_j) / sum_l (the same), masked keys 0 (LLN eq. 8-9).

    q (B,H,N,D), k (B,H,S,D) -> (B,H,R,S) in the compute dtype; alpha, beta > 0, floats or tensors
    broadcastable to (B,H,1,1); ``rows`` as ``select_rows``; causal needs S == N. Features in float64,
    each query and key shifted by its own max (the query shift cancels in the row normalisation, the
    key shift is added back in log space): a product only underflows when its exponents differ by > ~700.
    """
    check_qkv(q, k, k, same_length=causal)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    index = select_rows(rows, q.shape[2], q.device)
    aq = check_positive_scale("alpha", alpha, q).double() * q[:, :, index].double()
    bk = check_positive_scale("beta", beta, q).double() * k.double()
    key_shift = bk.amax(-1, keepdim=True)
    features = torch.exp(aq - aq.amax(-1, keepdim=True)) @ torch.exp(bk - key_shift).transpose(-1, -2)
    logits = features.clamp_min(torch.finfo(torch.float64).tiny).log() + key_shift.transpose(-1, -2)
    allowed = allowed_keys(index, k.shape[2], causal=causal, key_padding_mask=key_padding_mask)
    return masked_softmax(logits.to(compute_dtype(q)), allowed)


def lln_attention_reference(q: Tensor, k: Tensor, v: Tensor, alpha, beta, *, causal: bool = False,
                            key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """``lln_attention_weights`` @ v: the materialised LLN matrix (LLN eq. 8-9)."""
    check_qkv(q, k, v, same_length=causal)
    p = lln_attention_weights(q, k, alpha, beta, causal=causal, key_padding_mask=key_padding_mask)
    return (p @ v.to(p.dtype)).to(q.dtype)

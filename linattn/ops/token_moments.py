"""Each token row's moments of q and k, what LLN's moment matching sums (LLN §4.1; docs/design.md §3.1)."""
from typing import Optional

import torch
from torch import Tensor

from .impls import implementation_for
from .lln.autograd import IMPLEMENTATIONS as LLN_IMPLEMENTATIONS

_F64 = torch.float64


def token_moments(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, impl: str = "auto") -> Tensor:
    """q, k (B,H,N,D), key_padding_mask (B,N) bool (True = padded) or None -> (5,B,H,N): each token row's sum of q,
    of k, of q², of k² over its D entries, and D (the entries counted); a padded row all 0, whatever q and k hold
    there (inf, NaN). float32, float64 for float64 inputs: the matcher sums the rows over the tokens in float64.

    The rows are reduced in float32 straight from the input dtype, with no full-size upcast copy of q or k. Where
    LLN's implementation for q (``impls.implementation_for``: ``impl`` asked for by name and unable to take q is
    refused) has rows of its own (a ``token_moments`` in its file: ``fused``'s, one kernel that reads q and k once),
    those; elsewhere four reductions (their kernels upcast inside on CUDA) and the mask.
    """
    own = getattr(LLN_IMPLEMENTATIONS[implementation_for(LLN_IMPLEMENTATIONS, impl, q)], "token_moments", None)
    if own is not None:  # the table, not the method's name: traced whole
        return own(q, k, key_padding_mask)
    dtype = _F64 if _F64 in (q.dtype, k.dtype) else torch.float32
    rows = [x.sum(-1, dtype=dtype) for x in (q, k)]
    rows += [torch.linalg.vector_norm(x, 2, dim=-1, dtype=dtype) for x in (q, k)]
    rows = torch.stack(rows + [torch.full_like(rows[0], q.shape[-1])])
    rows[2:4].square_()  # sums of squares
    if key_padding_mask is None:
        return rows
    return torch.where(key_padding_mask[:, None, :], 0.0, rows)  # a padded row adds 0, NaN or inf included

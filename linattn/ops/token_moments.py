"""Each token row's moments of q and k, what LLN's moment matching sums (LLN §4.1; docs/design.md §3.1)."""
import torch
from torch import Tensor

from .impls import implementation_for
from .lln.autograd import IMPLEMENTATIONS as LLN_IMPLEMENTATIONS

_F64 = torch.float64


def token_moments(q: Tensor, k: Tensor, impl: str = "auto") -> Tensor:
    """q, k (B,H,N,D) -> (4,B,H,N) float64: each token row's sum of q, of k, of q², of k² over its D entries.

    The rows are reduced in float32 straight from the input dtype (float64 for float64 inputs), with no full-size
    upcast copy of q or k. Where LLN's ``impl`` resolves to ``fused`` for q (half q: ``lln/fused.supports``) one
    kernel reads q and k once (``triton/token_moments.py``); elsewhere four reductions (their kernels upcast inside
    on CUDA).
    """
    if implementation_for(LLN_IMPLEMENTATIONS, impl, q) == "fused":  # the table, not its name: traced whole
        from .triton.token_moments import token_moments as fused_moments
        return fused_moments(q, k.to(q.dtype)).to(_F64)
    dtypes = [_F64 if x.dtype == _F64 else torch.float32 for x in (q, k)]
    rows = [x.sum(-1, dtype=dtype) for x, dtype in zip((q, k), dtypes)]
    rows += [torch.linalg.vector_norm(x, 2, dim=-1, dtype=dtype) for x, dtype in zip((q, k), dtypes)]
    rows = torch.stack(rows).to(_F64)
    rows[2:].square_()  # sums of squares
    return rows

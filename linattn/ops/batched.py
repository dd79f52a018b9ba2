"""Helpers of the parallel implementations: one bmm over all leading dims, and rows cut into chunks (B,H,nc,c,·)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def bmm(a: Tensor, b: Tensor, add: Optional[Tensor] = None, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """a (...,M,K) @ b (...,K,P), or beta add + alpha a @ b, with the same leading dims, as one (b)bmm on merged
    batches (``torch.matmul`` of >3-D tensors launches a reshape besides)."""
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    if add is None:
        out = torch.bmm(a3, b3)
    else:
        out = torch.baddbmm(add.reshape(-1, *add.shape[-2:]), a3, b3, beta=beta, alpha=alpha)
    return out.view(*a.shape[:-2], *out.shape[-2:])


def chunks(x: Tensor, c: int, value: float = 0.0) -> Tensor:
    """(B,H,N,·) -> (B,H,nc,c,·) with nc = ceil(N / c), the last chunk padded with ``value``. Under
    ``torch.compile`` the pad is always traced (possibly 0 rows): lengths that are multiples of c share the graph."""
    pad = -x.shape[2] % c
    if torch.compiler.is_compiling() or pad:
        x = F.pad(x, (0, 0, 0, pad), value=value)
    return x.unflatten(2, (-1, c))


def rows(x: Tensor, n: int) -> Tensor:
    """(B,H,nc,c,·) -> its first n rows (B,H,n,·): the inverse of ``chunks``."""
    return x.flatten(2, 3)[:, :, :n]

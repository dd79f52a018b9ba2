"""Padding anywhere in a row: a method that counts positions runs over each row's real tokens, put first."""
import functools
from typing import Optional

import torch
from torch import Tensor

from linattn import ops


def _real_first_order(key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """(B, N) order putting each row's real tokens first (in their order), or None without a mask. Computed
    whenever there is a mask (the identity where the real tokens already come first): whether a row needs it
    is a tensor value, and branching on it would be a host sync."""
    if key_padding_mask is None:
        return None
    return torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True).indices


def _tokens(x: Optional[Tensor], order: Tensor, dim: int = 2) -> Optional[Tensor]:
    """x with its tokens (along ``dim``, batch on dim 0) in ``order`` (B, N). One ``index_select`` of (token, row)
    pairs: its backward keeps only the index (``gather`` would keep all of x for backward)."""
    if x is None:
        return None
    b, n = order.shape
    y = x.movedim((dim, 0), (0, 1))  # (N, B, ...): fairseq's own layout for q, k, v, a view of it
    rows = (order.t() * b + torch.arange(b, device=order.device)).reshape(-1)  # new (t, b) <- old (order[b, t], b)
    out = y.reshape(n * b, -1).index_select(0, rows).view(y.shape)
    return out.movedim((0, 1), (dim, 0))


def over_real_tokens(fn):
    """For a method whose blocks or windows count positions: ``fn(self, q, k, v, key_padding_mask, ...)`` runs
    with each row's real tokens first, so that padding anywhere (left padding too) changes no real token's
    output and real tokens are counted as fairseq counts their positions (docs/design.md §1.2)."""
    @functools.wraps(fn)
    def run(self, q, k, v, key_padding_mask=None, *args, **kwargs):
        order = None if self.cross else _real_first_order(key_padding_mask)
        if order is None:
            return fn(self, q, k, v, key_padding_mask, *args, **kwargs)
        out = fn(self, _tokens(q, order), _tokens(k, order), _tokens(v, order), _tokens(key_padding_mask, order, 1),
                 *args, **kwargs)
        return _tokens(out, order.argsort(1))
    return run


def rows_over_real_tokens(fn):
    """``over_real_tokens`` for ``attention_rows(self, q, k, key_padding_mask, rows, lln)``: the matrix of the
    reordered tokens, put back in the tokens' own order (rows and columns)."""
    @functools.wraps(fn)
    def run(self, q, k, key_padding_mask=None, rows=None, lln=None):
        order = None if self.cross else _real_first_order(key_padding_mask)
        if order is None:
            return fn(self, q, k, key_padding_mask, rows, lln)
        p = fn(self, _tokens(q, order), _tokens(k, order), _tokens(key_padding_mask, order, 1), None, lln)
        back = order.argsort(1)
        p = _tokens(_tokens(p, back, 2), back, 3)
        return p[:, :, ops.select_rows(rows, q.shape[2], q.device)]
    return run

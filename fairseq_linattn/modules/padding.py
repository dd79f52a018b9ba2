"""Padding anywhere in a row: a method that counts positions runs over each row's real tokens, put first."""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from linattn import ops


def _real_first_order(key_padding_mask: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    """(order (B, N) putting each row's real tokens first, in their order; the mask in that order), or None without a
    mask. Computed whenever there is a mask (the identity where the real tokens already come first): whether a row
    needs it is a tensor value, and branching on it would be a host sync."""
    if key_padding_mask is None:
        return None
    mask, order = torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True)
    return order, mask.bool()


def _token_rows(order: Tensor) -> Tensor:
    """(N·B,) rows of a (N, B, ...) tensor flattened to (N·B, ...): new (t, b) <- old (order[b, t], b)."""
    b = order.shape[0]
    return (order.t() * b + torch.arange(b, device=order.device)).reshape(-1)


def _tokens(x: Tensor, rows: Tensor, dim: int = 2, back: bool = False) -> Tensor:
    """x (batch on dim 0, tokens on ``dim``) with its tokens taken in the order of ``rows`` (``_token_rows``), or put
    back where they came from (``back``). ``index_select`` / ``index_copy`` keep only the index for backward
    (``gather`` would keep all of x)."""
    y = x.movedim((dim, 0), (0, 1))  # (N, B, ...): fairseq's own layout for q, k, v, a view of it
    flat = y.reshape(rows.numel(), -1)
    out = flat.new_empty(flat.shape).index_copy_(0, rows, flat) if back else flat.index_select(0, rows)
    return out.view(y.shape).movedim((0, 1), (dim, 0))


def over_real_tokens(fn):
    """For a method whose blocks or windows count positions: ``fn(self, q, k, v, key_padding_mask, ...)`` runs
    with each row's real tokens first, so that padding anywhere (left padding too) changes no real token's
    output and real tokens are counted as fairseq counts their positions (docs/design.md §1.2)."""
    @functools.wraps(fn)
    def run(self, q, k, v, key_padding_mask=None, *args, **kwargs):
        reordered = None if self.cross else _real_first_order(key_padding_mask)
        if reordered is None:
            return fn(self, q, k, v, key_padding_mask, *args, **kwargs)
        order, mask = reordered
        rows = _token_rows(order)
        out = fn(self, _tokens(q, rows), _tokens(k, rows), _tokens(v, rows), mask, *args, **kwargs)
        return _tokens(out, rows, back=True)
    return run


def rows_over_real_tokens(fn):
    """``over_real_tokens`` for ``attention_rows(self, q, k, key_padding_mask, rows, lln)``: the matrix of the
    reordered tokens, put back in the tokens' own order (rows and columns)."""
    @functools.wraps(fn)
    def run(self, q, k, key_padding_mask=None, rows=None, lln=None):
        reordered = None if self.cross else _real_first_order(key_padding_mask)
        if reordered is None:
            return fn(self, q, k, key_padding_mask, rows, lln)
        order, mask = reordered
        token_rows = _token_rows(order)
        p = fn(self, _tokens(q, token_rows), _tokens(k, token_rows), mask, None, lln)
        p = _tokens(_tokens(p, token_rows, 2, back=True), token_rows, 3, back=True)
        return p[:, :, ops.select_rows(rows, q.shape[2], q.device)]
    return run

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


def _token_rows(order: Tensor) -> Tuple[Tensor, Tensor]:
    """(N·B,) rows of a (N, B, ...) tensor flattened to (N·B, ...): new (t, b) <- old (order[b, t], b); and the
    inverse permutation, old <- new."""
    b = order.shape[0]
    rows = (order.t() * b + torch.arange(b, device=order.device)).reshape(-1)
    return rows, torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))


class _GatherRows(torch.autograd.Function):
    """x[take] for a permutation ``take`` of x's rows (``give``: its inverse). The gradient is a gather too,
    dy[give]: ``index_select``'s own backward zeroes a buffer and scatter-adds into it (atomics on a GPU). Only the
    index is kept for backward (``gather`` would keep all of x)."""

    @staticmethod
    def forward(ctx, x: Tensor, take: Tensor, give: Tensor) -> Tensor:
        ctx.save_for_backward(give)
        return x.index_select(0, take)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (give,) = ctx.saved_tensors
        return grad.index_select(0, give), None, None


def _tokens(x: Tensor, rows: Tuple[Tensor, Tensor], dim: int = 2, back: bool = False) -> Tensor:
    """x (batch on dim 0, tokens on ``dim``) with its tokens taken in the order of ``rows`` (``_token_rows``: the
    permutation and its inverse), or put back where they came from (``back``)."""
    forward, inverse = rows
    take, give = (inverse, forward) if back else (forward, inverse)
    y = x.movedim((dim, 0), (0, 1))  # (N, B, ...): fairseq's own layout for q, k, v, a view of it
    out = _GatherRows.apply(y.reshape(forward.numel(), -1), take, give)
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

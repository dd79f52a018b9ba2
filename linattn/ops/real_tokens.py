"""Padding anywhere in a row: the ops whose blocks or windows count positions count each row's real tokens, as if
its padding were removed (docs/design.md §1.2). The real-first order of a row puts its real tokens first, in their
order, then its padding; the block softmax's kernels read their rows through it, the other forms gather q, k, v in
it (``in_real_first_order``) and put the output back."""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .masking import select_rows


def real_first_order(key_padding_mask: Optional[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    """(order (B, N) putting each row's real tokens first, in their order; the mask in that order), or None without a
    mask. Computed whenever there is a mask (the identity where the real tokens already come first): whether a row
    needs it is a tensor value, and branching on it would be a host sync."""
    if key_padding_mask is None:
        return None
    mask, order = torch.sort(key_padding_mask.to(torch.uint8), dim=1, stable=True)
    return order, mask.bool()


def ranks(order: Tensor) -> Tensor:
    """(B, N): each token's place in its row's order (B, N) (``real_first_order``'s): the inverse permutation."""
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                            .expand_as(order))


def token_rows(order: Tensor) -> Tuple[Tensor, Tensor]:
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


def take_tokens(x: Tensor, rows: Tuple[Tensor, Tensor], dim: int = 2, back: bool = False) -> Tensor:
    """x (batch on dim 0, tokens on ``dim``) with its tokens taken in the order of ``rows`` (``token_rows``: the
    permutation and its inverse), or put back where they came from (``back``): a view of rows laid out as
    (N, B, ...), fairseq's layout for q, k, v."""
    forward, inverse = rows
    take, give = (inverse, forward) if back else (forward, inverse)
    y = x.movedim((dim, 0), (0, 1))  # (N, B, ...): fairseq's own layout for q, k, v, a view of it
    out = _GatherRows.apply(y.reshape(forward.numel(), -1), take, give)
    return out.view(y.shape).movedim((0, 1), (dim, 0))


class _PutBack(torch.autograd.Function):
    """An op's output (B,H,N,X) computed over the real-first order ``order`` (B,N), put back in the tokens' own order
    (``ranks``: the inverse permutation) as a new tensor, not a view: a gather along N. A compiled graph then
    plans no alias with it (docs/design.md §1.4). Its gradient gathers by the order (``gather``'s own backward would
    scatter-add)."""

    @staticmethod
    def forward(ctx, out: Tensor, order: Tensor, ranks: Tensor) -> Tensor:
        ctx.save_for_backward(order)
        return torch.gather(out, 2, _along_tokens(ranks, out))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return torch.gather(grad, 2, _along_tokens(order, grad)), None, None


def _along_tokens(index: Tensor, like: Tensor) -> Tensor:
    """A (B,N) index expanded to ``like``'s shape (B,H,N,X) along N (a view: one index a token)."""
    return index[:, None, :, None].expand(like.shape)


def over_reordered_tokens(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, order: Tensor, mask: Tensor,
                          *args, **kwargs) -> Tensor:
    """``fn(q, k, v, mask, *args, **kwargs)`` (q, k, v (B,H,N,·), output (B,H,N,·)) over q, k, v taken in the order
    ``order`` (B,N) (``real_first_order``'s, with ``mask`` in that order), its output put back in fairseq's layout
    (``take_tokens``: a view of a new (N,B,H,·) tensor, whose heads a module merges without a copy)."""
    rows = token_rows(order)
    out = fn(take_tokens(q, rows), take_tokens(k, rows), take_tokens(v, rows), mask, *args, **kwargs)
    return take_tokens(out, rows, back=True)


def in_real_first_order(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
                        key_padding_mask: Optional[Tensor], *args, **kwargs) -> Tensor:
    """An op ``fn(q, k, v, key_padding_mask, *args, **kwargs)`` (q, k, v (B,H,N,·), output (B,H,N,·)) run over each
    row's real tokens first, its output put back in the tokens' own order (a new contiguous tensor); ``fn`` as it
    is without a mask."""
    reordered = real_first_order(key_padding_mask)
    if reordered is None:
        return fn(q, k, v, key_padding_mask, *args, **kwargs)
    order, mask = reordered
    rows = token_rows(order)
    out = fn(take_tokens(q, rows), take_tokens(k, rows), take_tokens(v, rows), mask, *args, **kwargs)
    return _PutBack.apply(out, order, ranks(order))


def rows_in_real_first_order(fn: Callable[..., Tensor], q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor],
                             rows, *args, **kwargs) -> Tensor:
    """The attention rows ``fn(q, k, key_padding_mask, rows, *args, **kwargs)`` (B,H,R,N) of a method run over each
    row's real-first order (``in_real_first_order``): its whole matrix over the reordered tokens, its rows and
    columns put back in the tokens' own order, then the rows ``rows`` (``masking.select_rows``)."""
    reordered = real_first_order(key_padding_mask)
    if reordered is None:
        return fn(q, k, key_padding_mask, rows, *args, **kwargs)
    order, mask = reordered
    token_order = token_rows(order)
    p = fn(take_tokens(q, token_order), take_tokens(k, token_order), mask, None, *args, **kwargs)
    p = take_tokens(take_tokens(p, token_order, 2, back=True), token_order, 3, back=True)
    return p[:, :, select_rows(rows, q.shape[2], q.device)]

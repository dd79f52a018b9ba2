"""Windows of w consecutive rows of (B,H,N,C) tensors, processed in groups of working size.

Used by the ops that attend inside windows (LAVO's local part and memory, the block softmax of
LLN+Diag). The heads are flattened to (B·H, N, C) (a view for contiguous inputs and for fairseq's
permuted (T,B,H,D) projections). A group is either whole heads [h0, h1) or windows [f0, f1) of one
head, so that for a contiguous input its rows are one run of memory: a matmul reads them as a
(blocks, w, C) view without copying them, and the window before a group's first window sits right
in front of it (causal LAVO multiplies against [previous, own] window as one strided view). Rows that
are not one such run (a last window shorter than w, a non-contiguous input, nothing before the first
row) are copied into a fresh tensor, ``fill`` past the end.
"""
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor


class Group(NamedTuple):
    """Windows [f0, f1) of the flattened heads [h0, h1) (h1 = h0 + 1 unless the group holds whole heads)."""
    h0: int
    h1: int
    f0: int
    f1: int

    @property
    def heads(self) -> int:
        return self.h1 - self.h0

    @property
    def windows(self) -> int:
        return self.f1 - self.f0


def flat_heads(x: Tensor) -> Tensor:
    """(B,H,N,C) -> (B·H, N, C), a view whenever B and H merge."""
    return x.reshape(-1, *x.shape[2:])


_MAX_SHARE = 8  # a group holds at most 1/8 of all rows (its temporaries stay small beside the (N, D) tensors) ...
_MIN_SHARE_OF_WORK = 4  # ... unless that is below a quarter of the working size (small N: fewer, larger groups)


def window_groups(heads: int, n: int, w: int, c: int, work_elements: int) -> List[Group]:
    """Groups whose (rows, C) temporaries hold about ``work_elements`` values (at least one window), of equal size."""
    nw = -(-n // w)
    rows = min(work_elements // c, max(heads * nw * w // _MAX_SHARE, work_elements // (c * _MIN_SHARE_OF_WORK)))
    per = max(1, rows // w)  # windows per group
    if per >= nw:
        step = per // nw
        return [Group(h0, min(h0 + step, heads), 0, nw) for h0 in range(0, heads, step)]
    per = -(-nw // -(-nw // per))  # the same number of groups, of equal size
    return [Group(h, h + 1, f0, min(f0 + per, nw)) for h in range(heads) for f0 in range(0, nw, per)]


def _run(x3: Tensor, g: Group, w: int, before: int) -> Optional[Tensor]:
    """The group's rows (and ``before`` rows in front) as one (rows, C) view of x3, or None if they are not one run."""
    heads, n, c = x3.shape
    if not x3.is_contiguous() or g.f1 * w > n:  # whole heads have f1 * w = N only if N is a multiple of w
        return None
    start = g.h0 * n + g.f0 * w - before
    if start < 0:
        return None
    return x3.view(-1, c)[start:start + before + g.heads * g.windows * w]


def rows_view(x3: Tensor, g: Group, w: int) -> Optional[Tensor]:
    """Rows of group g of x3 as a (blocks, w, C) view (writes reach x3), or None if they are not one run."""
    run = _run(x3, g, w, 0)
    return None if run is None else run.view(-1, w, x3.shape[-1])


def group_rows(x3: Tensor, g: Group, w: int, *, context: bool = False, fill=0) -> Tensor:
    """Rows of group g of x3 (B·H, N, C) as (blocks, w, C), heads one after another, ``fill`` past N.

    ``context``: one more window first, the window before f0 (``fill`` if f0 = 0; between whole heads the
    previous head's last window stands before a head's window 0, so callers mask window 0's context).
    """
    before = w if context else 0
    run = _run(x3, g, w, before)
    if run is not None:
        return run.view(-1, w, x3.shape[-1])
    n, c = x3.shape[1:]
    out = x3.new_empty(before + g.heads * g.windows * w, c)
    if context:
        if g.f0 > 0:
            out[:w] = x3[g.h0, (g.f0 - 1) * w:g.f0 * w]
        else:
            out[:w] = fill
    body = out[before:].view(g.heads, g.windows * w, c)
    m = min(n, g.f1 * w) - g.f0 * w
    body[:, :m] = x3[g.h0:g.h1, g.f0 * w:g.f0 * w + m]
    body[:, m:] = fill
    return out.view(-1, w, c)


def window_pairs(rows: Tensor) -> Tensor:
    """(F+1, w, C) contiguous windows -> (F, 2w, C) strided view: entry f is windows f and f+1, no copy."""
    blocks, w, c = rows.shape
    return rows.as_strided((blocks - 1, 2 * w, c), (w * c, c, 1), rows.storage_offset())


def store_rows(dst3: Tensor, g: Group, w: int, val: Tensor, *, beta: float = 0.0) -> None:
    """Rows of group g of dst3 (B·H, N, C) <- beta · themselves + val (blocks, w, C); rows past N are dropped."""
    n, c = dst3.shape[1:]
    m = min(n, g.f1 * w) - g.f0 * w
    rows = dst3[g.h0:g.h1, g.f0 * w:g.f0 * w + m]
    src = val.reshape(g.heads, g.windows * w, c)[:, :m]
    if beta == 0:
        rows.copy_(src)
    elif beta == 1:
        rows += src
    else:
        rows.mul_(beta).add_(src)


def scaled_bmm(a: Tensor, b: Tensor, alpha: float, out: Optional[Tensor] = None) -> Tensor:
    """alpha a @ b, the scale applied inside the matmul; into ``out`` if given."""
    return torch.baddbmm(a.new_empty(()) if out is None else out, a, b, beta=0, alpha=alpha, out=out)


def bmm_rows(dst3: Tensor, g: Group, w: int, a: Tensor, b: Tensor, *, beta: float = 0.0, alpha: float = 1.0) -> None:
    """Rows of group g of dst3 <- beta · themselves + alpha a @ b; a (P,M,K), b (P,K,C) with P·M the group's rows.

    One matmul straight into dst3 when its rows are one run, else through a temporary.
    """
    view = rows_view(dst3, g, w)
    if view is None:
        store_rows(dst3, g, w, scaled_bmm(a, b, alpha), beta=beta)
        return
    view = view.view(a.shape[0], a.shape[1], dst3.shape[-1])
    torch.baddbmm(view, a, b, beta=beta, alpha=alpha, out=view)

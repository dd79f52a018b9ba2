"""Which keys a query row sees: row selection (R,), allowed keys (B|1,1,R,S) and a softmax restricted to them."""
from typing import Optional, Union

import torch
from torch import Tensor

Rows = Union[None, int, Tensor]


def select_rows(rows: Rows, n: int, device: torch.device) -> Tensor:
    """Row indices (R,) from None (all n), an int (that many evenly spaced rows) or a 1-D LongTensor."""
    if rows is None:
        return torch.arange(n, device=device)
    if isinstance(rows, int) and not isinstance(rows, bool):
        if rows < 1:
            raise ValueError(f"rows must be a positive int or a 1-D LongTensor of row indices, got {rows}")
        return torch.linspace(0, n - 1, min(rows, n), device=device).round().long().unique()
    if (not isinstance(rows, Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)
            or rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"rows must be a positive int or a non-empty 1-D LongTensor of indices in [0, {n}), "
                         f"got {rows!r}")
    return rows.to(device=device, dtype=torch.long)


def allowed_keys(index: Tensor, s: int, *, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    """(B or 1, 1, R, S) bool: True where query row ``index[r]`` may see key j (j <= index[r] if causal, not padded)."""
    j = torch.arange(s, device=index.device)
    allowed = (j[None, :] <= index[:, None]) if causal else torch.ones(len(index), s, dtype=torch.bool,
                                                                          device=index.device)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return allowed


def masked_softmax(scores: Tensor, allowed: Optional[Tensor] = None) -> Tensor:
    """Softmax over the last dim restricted to ``allowed`` (bool, broadcastable; None: all).

    Rows with nothing allowed (or only -inf scores) give 0, never NaN; a NaN score stays NaN.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.detach().amax(-1, keepdim=True)  # the shift cancels exactly: no gradient needed
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(scores - top)
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)

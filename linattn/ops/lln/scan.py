"""The in-place linear recurrence x[c] <- x[c] + a[c] x[c-1] of causal LLN's looped implementation (its chunk
states)."""
from torch import Tensor


def linear_scan_(x: Tensor, a: Tensor, reverse: bool = False) -> None:
    """In place along dim 2: x[c] <- x[c] + a[c] * x[c-1] (the updated x[c-1]); a is overwritten.

    x (B,H,L,D,E), a (B,H,L,D) multipliers broadcast over E; ``reverse`` runs from the end
    (x[c] <- x[c] + a[c] * x[c+1]). A work-efficient (Brent-Kung) scan: 2 log2(L) strided in-place
    updates instead of L small ones, each combining an earlier partial result (a1, x1) into a later
    one (a2, x2) as (a2 a1, x2 + a2 x1). Every multiplier is a product of decays <= 1: no overflow.
    """
    length = x.shape[2]

    def combine(start: int, step: int, span: int) -> None:
        count = len(range(start, length, step))  # later elements, in scan order
        if not count:
            return
        first = start if not reverse else length - 1 - start - (count - 1) * step
        earlier = first - span if not reverse else first + span
        later, later_a = x[:, :, first::step][:, :, :count], a[:, :, first::step][:, :, :count]
        prev, prev_a = x[:, :, earlier::step][:, :, :count], a[:, :, earlier::step][:, :, :count]
        later.addcmul_(prev, later_a[..., None])
        later_a.mul_(prev_a)

    span = 1
    while span < length:  # up-sweep: x[i] aggregates the block of 2*span elements ending at i
        combine(2 * span - 1, 2 * span, span)
        span *= 2
    while span > 1:  # down-sweep: complete the prefixes in between
        span //= 2
        combine(3 * span - 1, 2 * span, span)

"""Block softmax's validated inputs, as every implementation (``looped.py``, ``parallel.py``, ``fused.py``)
receives them, each built by the implementation's ``inputs``."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int


class BlockInputs(NamedTuple):
    """q, k (B,H,N,D), v (B,H,N,Dv); mask: which keys of its block a query may see, in the implementation's layout
    (its ``inputs``), or None where it may see all; causal; block: rows per block (<= N); order: for an
    implementation that reads the rows through it (``READS_REAL_FIRST``) with a mask, each row's real-first order
    (B,N) int32 (``real_tokens``), whose rows the blocks hold; else None."""
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Optional[Tensor]
    causal: bool
    block: int
    order: Optional[Tensor] = None


def block_inputs(q, k, v, key_padding_mask, block_size: int, causal: bool, implementation) -> BlockInputs:
    """Validated inputs for ``implementation`` (its module: ``looped``, ``parallel`` or ``fused``; q, k, v checked
    by the caller), built by its ``inputs(q, k, v, key_padding_mask, bs, causal)`` with bs = min(block_size, N):
    ``looped`` gets q, k, v in the compute dtype and as mask the visible keys (B|1,nb*bs); ``parallel`` gets them in
    their own dtype and as mask the hidden keys (B|1,1,nb,bs|1,bs), causality included (both: blocks of consecutive
    rows); ``fused`` in their own dtype with the key padding mask (B,N) as given and its real-first order (the
    kernel reads the rows through it and forms the rest)."""
    block_size = check_positive_int("block_size", block_size)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    n = q.shape[2]
    bs = min(block_size, n)
    return implementation.inputs(q, k, v, key_padding_mask, bs, causal)


def visible_keys(key_padding_mask: Optional[Tensor], n: int, bs: int, device) -> Optional[Tensor]:
    """(B|1, nb*bs) keys a query may see (not padded, before the end), or None when every key may be seen."""
    nb = -(-n // bs)
    if key_padding_mask is None and nb * bs == n:
        return None
    valid = (torch.arange(nb * bs, device=device) < n)[None]
    if key_padding_mask is not None:
        valid = valid & ~F.pad(key_padding_mask, (0, nb * bs - n), value=True)
    return valid


def hidden_keys(valid: Optional[Tensor], bs: int, causal: bool, device) -> Optional[Tensor]:
    """(B|1,1,nb,bs|1,bs): True where a query may not see a key of its block (padded, past the end, or later if
    causal), or None."""
    hidden = None if valid is None else ~valid.view(valid.shape[0], 1, -1, 1, bs)
    if causal:
        future = torch.ones(bs, bs, dtype=torch.bool, device=device).triu(1)
        hidden = future if hidden is None else hidden | future
    return hidden

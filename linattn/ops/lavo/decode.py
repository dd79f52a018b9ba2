"""LAVO decoding one token at a time: q_t, k_t, v_t (B,H,1,D) against a state of the last w-1 keys and values
and the memory sums (B,H,r), O(w D + r D)."""
import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..inputs import check_positive_int
from ..masking import masked_softmax
from ..precision import autocast_off
from .inputs import check_lavo
from .memory import memory_readout


def lavo_init_state(batch_size: int, num_heads: int, head_dim: int, num_bases: int, *, window: int,
                    dtype: torch.dtype = torch.float32, device=None) -> Dict[str, Tensor]:
    """Empty decoding state for ``lavo_decode_step`` (half dtypes are kept in float32).

    - ``prev_key``, ``prev_value`` (B,H,w-1,D): the last w-1 keys/values
    - ``prev_key_padding_mask`` (B,w-1) bool: True where that slot holds no real token (padding, or
      before the start)
    - ``mem_sum`` (B,H,r), ``mem_count`` (B,): sum of B x_t over the real tokens of completed windows
      and their number
    - ``window_sum`` (B,H,r), ``window_count`` (B,): the same over the current window's real tokens so far
    - ``position`` (B,) long: index t of the next real token (padded tokens are skipped)
    Every tensor has the batch on dim 0, so beam reordering is
    ``{name: t.index_select(0, new_order) for name, t in state.items()}``.
    """
    window = check_positive_int("window", window)
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    kv = dict(dtype=dtype, device=device)
    return {
        "prev_key": torch.zeros(batch_size, num_heads, window - 1, head_dim, **kv),
        "prev_value": torch.zeros(batch_size, num_heads, window - 1, head_dim, **kv),
        "prev_key_padding_mask": torch.ones(batch_size, window - 1, dtype=torch.bool, device=device),
        "mem_sum": torch.zeros(batch_size, num_heads, num_bases, **kv),
        "mem_count": torch.zeros(batch_size, **kv),
        "window_sum": torch.zeros(batch_size, num_heads, num_bases, **kv),
        "window_count": torch.zeros(batch_size, **kv),
        "position": torch.zeros(batch_size, dtype=torch.long, device=device),
    }


@autocast_off
def lavo_decode_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, bases: Tensor, pos_bias: Tensor,
                     state: Dict[str, Tensor], *, window: int, key_padding_mask: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One causal LAVO token: q_t, k_t, v_t (B,H,1,D) -> (out (B,H,1,D), new_state); O(w D + r D).

    ``key_padding_mask`` (B,1), True where this token is padding (None: all real): a padded token
    leaves its row's state as it was (it enters no window and no memory, and counts no position), so
    real tokens count positions among themselves. Equals ``lavo_attention(..., causal=True)`` at
    position ``state["position"]`` of the row's real tokens alone.
    """
    w, key_padding_mask = check_lavo(q_t, k_t, v_t, bases, pos_bias, window, key_padding_mask)
    b, h, n, d = q_t.shape
    if n != 1:
        raise ValueError(f"q_t, k_t, v_t must hold one token, shape (B, H, 1, D), got {tuple(q_t.shape)}")
    if tuple(state["prev_key"].shape) != (b, h, w - 1, d):
        raise ValueError(f"state['prev_key'] must have shape (B, H, w-1, D) = {(b, h, w - 1, d)}, "
                         f"got {tuple(state['prev_key'].shape)} (was the state made with this window?)")
    ct = state["mem_sum"].dtype
    q, k, v, bases_, pos_bias_ = (x.to(ct) for x in (q_t, k_t, v_t, bases, pos_bias))
    pad = torch.zeros(b, 1, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    pos = state["position"]
    keys = torch.cat([state["prev_key"], k], dim=2)  # positions t-w+1 .. t
    values = torch.cat([state["prev_value"], v], dim=2)
    key_pad = torch.cat([state["prev_key_padding_mask"], pad], dim=1)  # (B,w)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(d) + pos_bias_[:, None, :w]  # P[j - t + w - 1] = P[c]
    x = masked_softmax(scores, ~key_pad[:, None, None, :]) @ values  # F_local,t
    mem_count = state["mem_count"]
    mean = state["mem_sum"] / mem_count.clamp_min(1)[:, None, None]
    qb = torch.einsum("bhnd,hrd->bhnr", q, bases_)
    glob = memory_readout(qb, mean[:, :, None, :], bases_, 1.0 / math.sqrt(d))
    out = torch.where((mem_count > 0)[:, None, None, None], 0.5 * (x + glob), x)

    window_sum = state["window_sum"] + torch.einsum("bhd,hrd->bhr", x[:, :, 0], bases_)  # LAVO eq. 3
    window_count = state["window_count"] + 1
    ends = (pos + 1) % w == 0  # this token completes its window: fold it into memory
    new_state = {
        "prev_key": keys[:, :, 1:],
        "prev_value": values[:, :, 1:],
        "prev_key_padding_mask": key_pad[:, 1:],
        "mem_sum": torch.where(ends[:, None, None], state["mem_sum"] + window_sum, state["mem_sum"]),
        "mem_count": torch.where(ends, mem_count + window_count, mem_count),
        "window_sum": torch.where(ends[:, None, None], torch.zeros_like(window_sum), window_sum),
        "window_count": torch.where(ends, torch.zeros_like(window_count), window_count),
        "position": pos + 1,
    }
    kept = pad[:, 0]  # a padded token: the row's state stays as it was
    new_state = {name: torch.where(kept.view(-1, *[1] * (t.dim() - 1)), state[name], t)
                 for name, t in new_state.items()}
    return out.to(q_t.dtype), new_state

"""Each token row's moments for LLN's moment matching (LLN §4.1, docs/design.md §3.1), the custom op
``linattn::token_moments``: one program per block of ROWS token rows of one head reads q and k once, in their half
dtype, and sums each row's D entries and their squares in fp32, with the row's count of entries (D; padded rows:
all 0, whatever q and k hold there), so that the matcher's sums over the tokens are one reduction. The four
separate reductions it replaces read q and k twice each.
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import block, cdiv, each_in_layout, launch, mask_bytes, tile_at
from .kernel_op import kernel_op

ROWS = 64  # token rows a program


@triton.jit
def _row_moments(q_ptr, k_ptr, mask_ptr, out_ptr, BH, H, N, D, SQ, SK, BLOCK: tl.constexpr, BD: tl.constexpr,
                 HAS_MASK: tl.constexpr, FAIRSEQ: tl.constexpr):
    """out (5, B·H, N) fp32 at this block's rows: sum q, sum k, sum q², sum k² over each row's D entries, and D; 0 on
    a padded row (mask (B,N), nonzero = padded; q, k in fairseq's layout, head strides SQ, SK, or contiguous,
    ``common.tile_at``)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    ok = rows < N
    real = ok
    if HAS_MASK:
        real = ok & (tl.load(mask_ptr + (pid // H) * N + rows, mask=ok, other=1) == 0)
    live = real[:, None] & (d[None, :] < D)
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQ, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    kk = tl.load(k_ptr + tile_at(pid, rows, d, N, SK, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    row = out_ptr + pid * N + rows
    plane = BH * N
    tl.store(row, tl.sum(qq, 1), mask=ok)
    tl.store(row + plane, tl.sum(kk, 1), mask=ok)
    tl.store(row + 2 * plane, tl.sum(qq * qq, 1), mask=ok)
    tl.store(row + 3 * plane, tl.sum(kk * kk, 1), mask=ok)
    tl.store(row + 4 * plane, tl.where(real, D, 0).to(tl.float32), mask=ok)


@kernel_op("token_moments")
def token_moments(q: Tensor, k: Tensor, mask: Optional[Tensor]) -> Tensor:
    """q, k (B,H,N,D) half, one shape; mask (B,N) bool (True = padded) or None -> (5,B,H,N) fp32: each row's sum
    of q, of k, of q², of k², and D; 0 on a padded row."""
    b, h, n, d = q.shape
    out = _empty(q)
    fairseq, (sq, sk), (q, k) = each_in_layout(q, k)
    _row_moments[(b * h, cdiv(n, ROWS))](q, k, mask_bytes(mask, q), out, b * h, h, n, d, sq, sk, BLOCK=ROWS,
                                         BD=block(d), HAS_MASK=mask is not None, FAIRSEQ=fairseq,
                                         **launch("lln_token_moments", d))
    return out


@torch.library.register_fake(token_moments)
def _(q, k, mask):
    return _empty(q)


def _empty(q: Tensor) -> Tensor:
    return q.new_empty((5, *q.shape[:3]), dtype=torch.float32)

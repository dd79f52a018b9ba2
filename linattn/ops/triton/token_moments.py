"""Each token row's moments for LLN's moment matching (LLN §4.1, docs/design.md §3.1), the custom op
``linattn::token_moments``: one program per block of ROWS token rows of one head reads q and k once, in their half
dtype, and sums each row's D entries and their squares in fp32. The four separate reductions it replaces read q and
k twice each.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import block, each_in_layout, launch, tile_at

ROWS = 64  # token rows a program


@triton.jit
def _row_moments(q_ptr, k_ptr, out_ptr, BH, N, D, SQ, SK, BLOCK: tl.constexpr, BD: tl.constexpr, FAIRSEQ: tl.constexpr):
    """out (4, B·H, N) fp32 at this block's rows: sum q, sum k, sum q², sum k² over each row's D entries (q, k in
    fairseq's layout, head strides SQ, SK, or contiguous, ``common.tile_at``)."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    ok = rows < N
    live = ok[:, None] & (d[None, :] < D)
    qq = tl.load(q_ptr + tile_at(pid, rows, d, N, SQ, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    kk = tl.load(k_ptr + tile_at(pid, rows, d, N, SK, BH, FAIRSEQ), mask=live, other=0.0).to(tl.float32)
    row = out_ptr + pid * N + rows
    plane = BH * N
    tl.store(row, tl.sum(qq, 1), mask=ok)
    tl.store(row + plane, tl.sum(kk, 1), mask=ok)
    tl.store(row + 2 * plane, tl.sum(qq * qq, 1), mask=ok)
    tl.store(row + 3 * plane, tl.sum(kk * kk, 1), mask=ok)


@torch.library.custom_op("linattn::token_moments", mutates_args=())
def token_moments(q: Tensor, k: Tensor) -> Tensor:
    """q, k (B,H,N,D) half, one shape -> (4,B,H,N) fp32: each row's sum of q, of k, of q², of k²."""
    b, h, n, d = q.shape
    out = _empty(q)
    fairseq, (sq, sk), (q, k) = each_in_layout(q, k)
    _row_moments[(b * h, triton.cdiv(n, ROWS))](q, k, out, b * h, n, d, sq, sk, BLOCK=ROWS, BD=block(d),
                                               FAIRSEQ=fairseq, **launch("lln_token_moments", d))
    return out


@token_moments.register_fake
def _(q, k):
    return _empty(q)


def _empty(q: Tensor) -> Tensor:
    return q.new_empty((4, *q.shape[:3]), dtype=torch.float32)

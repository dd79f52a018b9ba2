"""The per-feature maximum of beta k over blocks of keys, padded keys left out: the key shifts of LLN's kernels
(LLN eq. 8 features referenced to their maximum), read once from the half keys instead of through fp32 copies.

``key_block_max`` is called inside the custom op ``lln_noncausal`` (a split's maxima; the causal op's ``_states``
keeps its running maximum itself); it is no op of its own.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import block, cdiv, each_in_layout, launch, tile_at


@triton.jit
def _block_max(k_ptr, beta_ptr, mask_ptr, out_ptr, BH, H, N, D, SK, NB, ROWS, BR: tl.constexpr, BD: tl.constexpr,
               HAS_MASK: tl.constexpr, FAIRSEQ: tl.constexpr):
    """One block of ROWS keys of one head (k in fairseq's layout, head stride SK, or contiguous: ``common.tile_at``):
    out[d, block] = max over its unpadded keys of beta k_d, -inf if none."""
    c = tl.program_id(0)
    pid = tl.program_id(1)
    d = tl.arange(0, BD)
    beta = tl.load(beta_ptr + pid)
    top = tl.full((BD,), float("-inf"), tl.float32)
    for start in range(c * ROWS, tl.minimum(c * ROWS + ROWS, N), BR):
        rows = start + tl.arange(0, BR)
        ok = (rows < N) & (rows < c * ROWS + ROWS)
        if HAS_MASK:
            ok = ok & (tl.load(mask_ptr + (pid // H) * N + rows, mask=ok, other=1) == 0)
        live = ok[:, None] & (d[None, :] < D)
        at = tile_at(pid, rows, d, N, SK, BH, FAIRSEQ)
        bk = tl.load(k_ptr + at, mask=live, other=0.0).to(tl.float32) * beta
        top = tl.maximum(top, tl.max(tl.where(live, bk, float("-inf")), 0))
    tl.store(out_ptr + (pid * D + d) * NB + c, top, mask=d < D)


def key_block_max(k: Tensor, beta: Tensor, mask_u8: Tensor, has_mask: bool, rows: int) -> Tensor:
    """k (B,H,N,D) half (in fairseq's layout, packed too, or contiguous: read in place); beta (B,H) fp32; mask_u8
    (B,N) uint8 (any tensor when not ``has_mask``) -> (B,H,D,nb) fp32: the maximum of beta k over each block of
    ``rows`` keys, -inf where a block has no key."""
    b, h, n, d = k.shape
    nb = cdiv(n, rows)
    fairseq, (sk,), (k,) = each_in_layout(k)
    out = torch.empty((b, h, d, nb), dtype=torch.float32, device=k.device)
    _block_max[(nb, b * h)](k, beta, mask_u8, out, b * h, h, n, d, sk, nb, rows, BR=min(block(rows), 64),
                            BD=block(d), HAS_MASK=has_mask, FAIRSEQ=fairseq, **launch("lln_key_max", d))
    return out

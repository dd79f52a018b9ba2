"""Block softmax's fused implementation: one Triton program per block (``ops/triton/block_softmax.py``; docs/design.md
§1.3.1), forward and backward.

``BlockInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in their own half dtype and as mask the key padding mask (B,N)
(True = padded) with its real-first order (B,N) int32, or both None (``inputs``): the kernel reads each block's rows
through the order (``READS_REAL_FIRST``: the op gathers nothing) and forms its visible keys (not padded, before the
end, not later if causal). ``SUPPORT`` and ``not_supported_reasons`` say which inputs the kernels take.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..impls import Support
from ..lln.fused import HALF_DTYPES, MAX_ELEMENTS, MAX_HEAD_DIM
from ..packed_heads import packs_grads
from ..real_tokens import real_first_order
from .inputs import BlockInputs

READS_REAL_FIRST = True  # the kernels read each block's rows through the key padding mask's real-first order
MAX_BLOCK = 128  # the largest block: its (bs, bs) scores are held in registers
SHARED_MEMORY_KIB = {64: 48, 128: 96}  # the largest kernel block at D <= 64 and <= 128, sm_90
SUPPORT = Support(dtypes=HALF_DTYPES, devices=("cuda",), triton=True, causal=True, max_head_dim=MAX_HEAD_DIM,
                  max_elements=MAX_ELEMENTS, shared_memory_kib=SHARED_MEMORY_KIB)


def not_supported_reasons(q: Tensor, v: Tensor, *, causal: bool = False, block: int = 64,
                          device: Optional[torch.device] = None) -> List[str]:
    """Why the kernels cannot take queries like q (B,H,N,D), values like v (B,H,N,Dv) and blocks of ``block`` rows
    (``SUPPORT``'s reasons, on ``device`` for a stand-in q, and block <= MAX_BLOCK); [] where they can."""
    reasons = SUPPORT.reasons(q, v, causal=causal, device=device)
    if block > MAX_BLOCK:
        reasons.append(f"block {block} > {MAX_BLOCK} (its scores are held in registers)")
    return reasons


def inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], bs: int, causal: bool) -> BlockInputs:
    """q, k, v in their own dtype with the key padding mask (B,N) as given and its real-first order (B,N) int32."""
    order = None if key_padding_mask is None else real_first_order(key_padding_mask)[0].to(torch.int32)
    return BlockInputs(q, k, v, key_padding_mask, causal, bs, order)


def forward(x: BlockInputs, *, average_with: Optional[Tensor] = None) -> Tuple[Tensor, tuple]:
    """Block softmax (B,H,N,Dv), or 0.5 (average_with + block softmax) with ``average_with`` (B,H,N,Dv) fp32; in q's
    dtype. Nothing to save (the backward recomputes the probabilities)."""
    from ..triton.block_softmax import block_softmax
    return block_softmax(x.q, x.k, x.v, x.mask, x.order, x.block, x.causal, average_with), ()


def backward(x: BlockInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0,
             add_to: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (B,H,N,·) in q's dtype of ``scale`` * block softmax (probabilities recomputed), plus ``add_to``
    (another part's dq, dk, dv, as LLN's in LLN+Diag) if given, added in fp32 in the kernel."""
    from ..triton.block_softmax import block_softmax_backward
    from ..triton.common import grads_of

    grads = block_softmax_backward(x.q, x.k, x.v, grad, x.mask, x.order, x.block, x.causal, float(scale),
                                   *(add_to or (None, None, None)), packs_grads(x.q, x.k, x.v))
    return grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v

"""LLN's fused implementation: Triton kernels registered as custom ops (``ops/triton/lln_*.py``; docs/design.md
§1.3.1), forward and backward.

``forward`` and ``backward`` take ``LLNInputs`` x with q, k (B,H,N,D), v (B,H,N,Dv) in their own half dtype, read
as half by the kernels (fp32 accumulation). The shifts are the parallel implementation's
(``parallel._causal_shifts``), computed by the kernels from the half inputs, so the stabilisation, and the causal
op's independence of future tokens, are unchanged. ``SUPPORT`` and ``not_supported_reasons`` say which inputs the
kernels take (``impls.implementation_for`` refuses the others). The moment matcher's kernels are this
implementation's too: ``token_moments``, ``lln_scales`` and ``lln_scales_recorded`` (``triton/token_moments.py``,
``triton/moment_match.py``; docs/design.md §3.1), run where LLN runs fused.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..impls import Support
from ..packed_heads import packs_grads
from .inputs import LLNInputs

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # the largest D and Dv a kernel holds in registers
MAX_CHUNK = 128  # the largest causal chunk: its C×C products are held in registers
MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32: a larger q, k or v runs ``parallel``
SHARED_MEMORY_KIB = {64: 80, 128: 224}  # the largest block (the causal ``_grads``) at D <= 64 and <= 128, sm_90
SUPPORT = Support(dtypes=HALF_DTYPES, devices=("cuda",), triton=True, causal=True, max_head_dim=MAX_HEAD_DIM,
                  max_elements=MAX_ELEMENTS, shared_memory_kib=SHARED_MEMORY_KIB)
PER_HEAD_SCALES = True  # the kernels read alpha, beta as the (B, H) stacks of ``lln_inputs(per_head=True)``


def not_supported_reasons(q: Tensor, v: Tensor, *, causal: bool = False, chunk: int = 64,
                          device: Optional[torch.device] = None) -> List[str]:
    """Why the kernels cannot take queries like q (B,H,N,D) and values like v (B,H,S,Dv), causal in chunks of
    ``chunk`` rows if ``causal`` (``SUPPORT``'s reasons, on ``device`` for a stand-in q, and causal: chunk <=
    MAX_CHUNK, fewer than 2^31 elements in the chunk states (B,H,N/chunk,D,Dv+1)); [] where they can."""
    reasons = SUPPORT.reasons(q, v, causal=causal, device=device)
    if causal:
        b, h, n, d = q.shape
        states = b * h * -(-n // chunk) * d * (v.shape[-1] + 1)
        if chunk > MAX_CHUNK:
            reasons.append(f"causal chunk {chunk} > {MAX_CHUNK} (its C×C products are held in registers)")
        if states > MAX_ELEMENTS:
            reasons.append(f"{states} elements in the causal chunk states > {MAX_ELEMENTS} (int32 indices)")
    return reasons


def forward(x: LLNInputs, *, averaged: bool = False) -> Tuple[Tensor, tuple]:
    """LLN (B,H,N,Dv) in q's dtype (fp32 if ``averaged``) and what ``backward`` needs: the output in q's dtype (the
    kernels store it rounded beside the fp32 one if ``averaged``: no conversion after them), then non-causal (m, s,
    den), causal (m_incl, m_prev, g, rho, lse, s, den), then alpha, beta one per head (B,H) as the kernels read them
    (kept: the backward makes no copy of its own)."""
    alpha, beta = _per_head(x)
    if not x.causal:
        from ..triton.lln_noncausal import lln_noncausal
        out, half, s, den, m = lln_noncausal(x.q, x.k, x.v, alpha, beta, x.mask, averaged)
        return out, (half if averaged else out, m, s, den, alpha, beta)
    from ..triton.lln_causal import lln_causal
    out, half, s, den, m_prev, m_incl, g, rho, lse = lln_causal(x.q, x.k, x.v, alpha, beta, x.mask, x.chunk, averaged)
    return out, (half if averaged else out, m_incl, m_prev, g, rho, lse, s, den, alpha, beta)


def backward(x: LLNInputs, saved: tuple, grad: Tensor, *, scale: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (in the inputs' half dtype, computed in fp32) of ``scale`` * LLN from ``forward``'s ``saved`` and
    dL/d(out) (B,H,N,Dv), in the backward kernels (``triton/lln_causal_backward.py``,
    ``triton/lln_noncausal_backward.py``)."""
    from ..triton.common import grads_of

    out, *state, alpha, beta = saved
    if not x.causal:
        from ..triton.lln_noncausal_backward import lln_noncausal_backward
        m, s, den = state
        grads = lln_noncausal_backward(x.q, x.k, x.v, grad, out, alpha, beta, m, s, den, x.mask, float(scale),
                                       packs_grads(x.q, x.k, x.v))
    else:
        from ..triton.lln_causal_backward import lln_causal_backward
        m_incl, m_prev, g, rho, lse, s, den = state
        grads = lln_causal_backward(x.q, x.k, x.v, grad, out, den, alpha, beta, x.mask, m_prev, m_incl, g, rho, lse,
                                    s, float(scale), packs_grads(x.q, x.k, x.v))
    return grads_of(*grads, x.q.shape[-1])  # views of one tensor for the module's packed q, k, v


def _per_head(x: LLNInputs) -> Tuple[Tensor, Tensor]:
    """alpha, beta (B,H) fp32, one per head as the kernels read them: as they are where each is a contiguous
    (B,H,1,1) tensor (tensors given, stacked so by their check: ``lln_inputs``' ``per_head``), else two contiguous
    halves of one stack (one launch)."""
    b, h = x.q.shape[:2]
    if all(t.shape == (b, h, 1, 1) and t.dtype == torch.float32 and t.is_contiguous() for t in (x.alpha, x.beta)):
        return x.alpha.view(b, h), x.beta.view(b, h)
    return tuple(torch.stack([t.expand(b, h, 1, 1) for t in (x.alpha, x.beta)]).view(2, b, h))


def token_moments(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """``ops.token_moments``' rows (5,B,H,N) fp32 of half q, k in one kernel that reads each once."""
    from ..triton.token_moments import token_moments as rows
    return rows(q, k.to(q.dtype), key_padding_mask)


def lln_scales(first: Tensor, second: Tensor, a: float, b: float, max_scale: float, fixed_alpha: float,
               fixed_beta: float, table: Optional[Tensor], dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """The moment matcher's statistics (5,G) float64 (sigma q, sigma k, alpha, beta, tau) and alpha, beta (2,G) in
    ``dtype``, from moments (5,G) or the running variances ``first``, ``second`` (G,), in one launch
    (``triton/moment_match.py``): alpha, beta fixed where ``fixed_alpha`` > 0 (mode ``off``), from ``table`` (2,T)
    (``exact``: log s² and log var(log P_LLN)) where given, else from the line a x + b."""
    from ..triton.moment_match import lln_scales as scales
    return scales(first, second, a, b, max_scale, fixed_alpha, fixed_beta, table, dtype)


def lln_scales_recorded(first: Tensor, second: Tensor, moments: Tensor, buf_q: Tensor, buf_k: Tensor,
                        batches: Optional[Tensor], pending: Optional[Tensor], a: float, b: float, max_scale: float,
                        fixed_alpha: float, fixed_beta: float, table: Optional[Tensor], momentum: float,
                        dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``lln_scales`` and, in the same launch, a training forward's moments (5,G) recorded: added to ``pending``
    if given, else folded into the running variances ``buf_q``, ``buf_k`` (``batches``: the running statistics'
    count, else an EMA of ``momentum``), which the scales read as they were before (``triton/moment_match.py``)."""
    from ..triton.moment_match import lln_scales_recorded as recorded
    return recorded(first, second, moments, buf_q, buf_k, batches, pending, a, b, max_scale, fixed_alpha, fixed_beta,
                    table, momentum, dtype)

"""LLN+Diag's fused implementation: LLN's kernels and the block softmax's (``lln/fused.py``,
``block_softmax/fused.py``), run by the one ``_LLNDiagAverage`` through their tables; this file only says which inputs
both take."""
from typing import List, Optional

import torch
from torch import Tensor

from ..block_softmax import fused as block_fused
from ..lln import fused as lln_fused

PER_HEAD_SCALES = lln_fused.PER_HEAD_SCALES  # its LLN part is LLN's kernels


def not_supported_reasons(q: Tensor, v: Tensor, *, causal: bool = False, chunk: int = 64, block: int = 64,
                          device: Optional[torch.device] = None) -> List[str]:
    """Why one part's kernels or both cannot take queries like q, values like v, causal chunks of ``chunk`` rows if
    ``causal`` and blocks of ``block`` rows (each reason once); [] where both can."""
    reasons = lln_fused.not_supported_reasons(q, v, causal=causal, chunk=chunk, device=device)
    return reasons + [r for r in block_fused.not_supported_reasons(q, v, causal=causal, block=block, device=device)
                      if r not in reasons]

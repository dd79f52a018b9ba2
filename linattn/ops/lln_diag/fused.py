"""LLN+Diag's fused implementation: LLN's kernels and the block softmax's (``lln/fused.py``,
``block_softmax/fused.py``), run by the one ``_LLNDiagAverage`` through their tables; this file only says which inputs
both take."""
from torch import Tensor

from ..block_softmax import fused as block_fused
from ..lln import fused as lln_fused


def supports(q: Tensor, v: Tensor, chunk: int = 64, block: int = 64) -> bool:
    """Whether both parts' kernels take queries like q, values like v, causal chunks of ``chunk`` rows and blocks of
    ``block`` rows."""
    return lln_fused.supports(q, v, chunk=chunk) and block_fused.supports(q, v, block=block)

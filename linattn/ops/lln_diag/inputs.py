"""The validated inputs of LLN+Diag's fused average: LLN's and its block softmax's, q, k, v held once."""
from typing import NamedTuple, Optional

from torch import Tensor

from ..block_softmax.inputs import BlockInputs, block_inputs
from ..lln.inputs import LLNInputs


class LLNDiagInputs(NamedTuple):
    """The fields of ``LLNInputs`` (q, k, v, alpha, beta, the key padding mask, causal, chunk) and of the block
    softmax's ``BlockInputs`` (its mask ``block_mask``, block, order ``block_order``): each part's inputs are
    ``lln`` and ``diag``."""
    q: Tensor
    k: Tensor
    v: Tensor
    alpha: Tensor
    beta: Tensor
    mask: Optional[Tensor]
    block_mask: Optional[Tensor]
    causal: bool
    chunk: int
    block: int
    block_order: Optional[Tensor]

    @property
    def lln(self) -> LLNInputs:
        return LLNInputs(self.q, self.k, self.v, self.alpha, self.beta, self.mask, self.causal, self.chunk)

    @property
    def diag(self) -> BlockInputs:
        return BlockInputs(self.q, self.k, self.v, self.block_mask, self.causal, self.block, self.block_order)


def lln_diag_inputs(x: LLNInputs, block_size: int, block_implementation) -> LLNDiagInputs:
    """LLN's validated inputs ``x`` (constant alpha, beta: learnt scales folded into q, k would reach the block
    softmax) with the block softmax's mask and block size for its implementation ``block_implementation`` (the
    module)."""
    diag = block_inputs(x.q, x.k, x.v, x.mask, block_size, x.causal, block_implementation)
    return LLNDiagInputs(x.q, x.k, x.v, x.alpha, x.beta, x.mask, diag.mask, x.causal, x.chunk, diag.block,
                        diag.order)

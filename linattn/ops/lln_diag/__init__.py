"""LLN+Diag (LLN §4.2, Fig. 3): LLN over the whole sequence mixed with block-diagonal softmax."""
from .autograd import lln_diag_attention
from .mixing import MIX_MODES, mix_lln_diag
from .reference import lln_diag_attention_reference, lln_diag_attention_weights

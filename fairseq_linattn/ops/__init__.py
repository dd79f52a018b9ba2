"""Pure-PyTorch attention ops (no fairseq import). Tensors are (B, H, N, D); see SPEC §1.1.

Each fast op has a ``*_reference`` twin that materialises the N×N matrix from the paper's formula.
"""
from .softmax import softmax_attention, softmax_attention_reference
from .block_softmax import block_softmax_attention, block_softmax_attention_reference
from .lln import lln_attention, lln_attention_reference
from .lln_diag import lln_diag_attention, lln_diag_attention_reference
# -- more ops are imported below, one line each --

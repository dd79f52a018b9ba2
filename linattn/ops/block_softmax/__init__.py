"""Softmax attention restricted to diagonal blocks (LLN §4.2, Fig. 3: the "Diag" of LLN+Diag)."""
from .autograd import block_softmax_attention
from .reference import block_softmax_attention_reference, block_softmax_weights

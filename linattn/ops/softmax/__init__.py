"""Softmax attention: the baseline every linear method is compared against (Vaswani et al. eq. 1)."""
from .reference import softmax_attention_reference, softmax_attention_weights
from .sdpa import softmax_attention

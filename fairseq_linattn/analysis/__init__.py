"""Concentration instruments (SPEC §8): pure PyTorch, no fairseq import."""
from .concentration import (
    attention_matrix,
    entropy,
    lln_temperature,
    log_moments,
    softmax_temperature,
    sparsity,
    spectral_gap,
)

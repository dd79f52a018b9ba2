"""Concentration instruments on attention matrices (docs/design.md §8): pure tensor functions.

- ``concentration``: entropy, spectral gap, sparsity, ln P moments, temperatures of row-stochastic matrices;
- ``synthetic``: the same measures for softmax and LLN on Gaussian q, k (LLN §3-4).
"""
from .concentration import entropy, lln_temperature, log_moments, softmax_temperature, sparsity, spectral_gap  # noqa: F401

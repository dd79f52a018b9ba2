"""Concentration instruments (docs/design.md §8); fairseq is imported only where needed (modules, checkpoints).

- ``concentration``: the measures on a row-stochastic matrix (entropy, spectral gap, sparsity, ln P
  moments, temperatures) and the softmax / LLN matrix from q, k;
- ``module_matrix``: the attention matrix of any of the plugin's attention modules;
- ``training_stats``: ``--attention-stats-interval`` (forward hooks, logged through ``metrics_hook``);
- ``cli`` (``python -m fairseq_linattn.analysis``): JSON and plots for a checkpoint or Gaussian q, k.
"""
from .concentration import (
    attention_matrix,
    entropy,
    lln_temperature,
    log_moments,
    softmax_temperature,
    sparsity,
    spectral_gap,
)
from .module_matrix import module_attention_matrix
from .training_stats import collect_attention_stats, install_attention_stats

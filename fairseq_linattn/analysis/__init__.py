"""Concentration instruments (docs/design.md §8); fairseq is imported only where needed (modules, checkpoints).

- ``concentration``: the measures on a row-stochastic matrix (entropy, spectral gap, sparsity, ln P
  moments, temperatures);
- ``module_matrix``: the attention matrix of any of the plugin's attention modules, from the module's
  own ``attention_rows`` (the rows come from the ops: ``ops.softmax_attention_weights``, ...);
- ``training_stats``: ``--attention-stats-interval`` (forward hooks, logged through ``metrics_hook``);
- ``cli`` (``python -m fairseq_linattn.analysis``): JSON and plots for a checkpoint or Gaussian q, k.
"""
from .concentration import (
    entropy,
    lln_temperature,
    log_moments,
    softmax_temperature,
    sparsity,
    spectral_gap,
)
from .module_matrix import module_attention_matrix
from .training_stats import collect_attention_stats, install_attention_stats

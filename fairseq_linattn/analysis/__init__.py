"""The instruments on the plugin's modules (docs/design.md §8); the measures are ``linattn.analysis``.

- ``module_matrix``: the attention matrix of any of the plugin's attention modules, from the module's
  own ``attention_rows`` (the rows come from the ops: ``ops.softmax_attention_weights``, ...);
- ``layer_stats``: a layer's statistics for one forward;
- ``training_stats``: ``--attention-stats-interval`` (forward hooks, logged through ``training_logs``).
"""
from .module_matrix import module_attention_matrix  # noqa: F401
from .training_stats import collect_attention_stats, install_attention_stats  # noqa: F401

"""The glue between the plugin and fairseq, run once when fairseq loads the plugin (``register``).

It registers the models (``linattn_roberta``, ``linattn_lm``, ``linattn_transformer``), applies the two
fairseq compatibility fixes (``fairseq_compat``), routes the plugin's statistics into fairseq's logging
(``metrics_hook``) and connects the ``--attention-stats-interval`` recorder of the analysis layer to
the models' build (``models.hooks``).
"""
_registered = False


def _install_attention_stats(model, config) -> None:
    from .analysis.training_stats import install_attention_stats

    install_attention_stats(model, config.attention_stats_interval)


def register() -> None:
    """Idempotent. Needs fairseq."""
    global _registered
    if _registered:
        return
    _registered = True  # first: importing the models below may come back here
    from . import metrics_hook
    from .fairseq_compat import allow_fairseq_checkpoints, restore_numpy_compat_long
    from .models import hooks, linattn_lm, linattn_roberta, linattn_transformer  # noqa: F401  (register them)

    allow_fairseq_checkpoints()
    restore_numpy_compat_long()
    metrics_hook.install()
    hooks.BUILD_HOOKS.append(_install_attention_stats)

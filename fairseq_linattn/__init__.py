"""fairseq_linattn: linear-complexity attention for fairseq (``--user-dir fairseq_linattn``).

Layers: ``ops`` (pure PyTorch) -> ``modules`` (fairseq attention modules) -> ``models`` (registered
fairseq models). Importing the package registers the models when fairseq is installed.
"""
try:
    import fairseq  # noqa: F401
except ImportError:  # the ops and analysis layers work without fairseq
    fairseq = None

if fairseq is not None:
    from . import models  # noqa: F401  (registers linattn_roberta, linattn_lm, linattn_transformer)
    from . import metrics_hook
    from .fairseq_compat import allow_fairseq_checkpoints, restore_numpy_compat_long

    allow_fairseq_checkpoints()
    restore_numpy_compat_long()
    metrics_hook.install()

"""fairseq_linattn: linear-complexity attention for fairseq (``--user-dir fairseq_linattn``).

Layers: ``ops`` (pure PyTorch) -> ``modules`` (fairseq attention modules) -> ``models`` (registered
fairseq models). Importing the package registers the models when fairseq is installed.
"""
import logging


def _import_fairseq():
    """Import fairseq, or None without it, leaving the root logger as the caller had it.

    Some of fairseq's modules call ``logging.basicConfig`` (level DEBUG in
    ``wav2vec2_classification.py``) when they are imported: on an unconfigured root logger that sends
    every library's DEBUG lines and fairseq's "install tensorboardX" notice to the console. A
    placeholder handler makes those calls no-ops; a caller's own set-up (``fairseq-train`` makes one
    before importing fairseq) is left alone.
    """
    root = logging.getLogger()
    placeholder = None if root.handlers else logging.NullHandler()
    if placeholder is not None:
        root.addHandler(placeholder)
    try:
        import fairseq
        import fairseq.models  # noqa: F401  (the imports that configure logging)
        import fairseq.tasks  # noqa: F401
        return fairseq
    except ImportError:  # the ops and analysis layers work without fairseq
        return None
    finally:
        if placeholder is not None:
            root.removeHandler(placeholder)


fairseq = _import_fairseq()

if fairseq is not None:
    from . import models  # noqa: F401  (registers linattn_roberta, linattn_lm, linattn_transformer)
    from . import metrics_hook
    from .fairseq_compat import allow_fairseq_checkpoints, restore_numpy_compat_long

    allow_fairseq_checkpoints()
    restore_numpy_compat_long()
    metrics_hook.install()

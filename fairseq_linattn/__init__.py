"""The fairseq plugin (``--user-dir fairseq_linattn``): importing it registers the models.

``linattn_roberta``, ``linattn_lm`` and ``linattn_transformer`` (``models/``) are registered by plain
imports, as fairseq's own plugins do; ``fairseq_fixes.apply_fairseq_fixes`` makes fairseq 0.12 work on
today's torch and NumPy; ``training_logs`` routes the attention statistics into fairseq's logging; the
``--attention-stats-interval`` recorder (``analysis``) is attached to every model the plugin builds;
``options.install_cli_errors`` makes a bad plugin option end a fairseq command line as argparse does.
The attention ops themselves live in the fairseq-free package ``linattn``; the tools (data
preparation, benchmarks, reproduction, self-test) in ``linattn_tools``, which this package never imports.
"""
import logging

_root = logging.getLogger()
# some of fairseq's modules call logging.basicConfig(level=DEBUG) when first imported: a placeholder handler on
# an unconfigured root logger makes that a no-op (a caller's own logging set-up is kept)
_placeholder = None if _root.handlers else logging.NullHandler()
if _placeholder is not None:
    _root.addHandler(_placeholder)
try:
    from . import models  # noqa: E402,F401  (registers the models and their architectures)
    from .analysis.training_stats import install_attention_stats  # noqa: E402
    from .fairseq_fixes import apply_fairseq_fixes  # noqa: E402
    from .models.on_build import ON_BUILD  # noqa: E402
    from .options import install_cli_errors  # noqa: E402
    from .training_logs import log_statistics_through_tasks  # noqa: E402
finally:
    if _placeholder is not None:
        _root.removeHandler(_placeholder)

apply_fairseq_fixes()
install_cli_errors()
log_statistics_through_tasks()
if install_attention_stats not in ON_BUILD:
    ON_BUILD.append(install_attention_stats)

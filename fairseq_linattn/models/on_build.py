"""Functions called on every model the plugin builds, as ``fn(model, interval)`` with the
``--attention-stats-interval`` value; the package's ``__init__`` adds the recorder of the analysis layer
(the models do not import it)."""
from typing import Callable, List

ON_BUILD: List[Callable] = []


def after_build(model, config) -> None:
    """Run every ``ON_BUILD`` function on a freshly built ``model`` (``config``: its ``AttentionConfig``)."""
    for fn in ON_BUILD:
        fn(model, config.attention_stats_interval)

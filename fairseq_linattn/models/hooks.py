"""What runs on a freshly built model of the plugin: callbacks that the plugin's glue registers.

The models do not import the analysis layer; ``fairseq_linattn.plugin`` adds the
``--attention-stats-interval`` recorder here when fairseq loads the plugin.
"""
from typing import Callable, List

BUILD_HOOKS: List[Callable] = []  # each called as hook(model, config: AttentionConfig)


def after_build(model, config) -> None:
    for hook in BUILD_HOOKS:
        hook(model, config)

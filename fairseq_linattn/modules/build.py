"""``build_attention``: the module of a method for a role, from ``ATTENTION_CLASSES`` (``registry.py``), which the
method files imported here fill (``@register_attention`` on each class)."""
from typing import Mapping, Union

from linattn.config import AttentionConfig
from linattn.methods import METHODS, methods_for

from . import kernelized, lavo, lln, lln_diag, skyformer, softmax  # noqa: F401  (each registers its class)
from .base import AttentionBase
from .registry import ATTENTION_CLASSES


def build_attention(method: str, embed_dim: int, num_heads: int, *, causal: bool, dropout: float = 0.0,
                    config: Union[None, AttentionConfig, Mapping] = None, cross: bool = False, **kw) -> AttentionBase:
    """The module for ``method`` as self-attention (``causal`` or not) or ``cross``-attention.

    ``config``: the plugin's options (an ``AttentionConfig``, or a mapping of option names to values for
    the others' defaults, validated here); ``kw``: kdim, vdim, bias.
    """
    role = "cross" if cross else "decoder" if causal else "encoder"
    if method not in METHODS or role not in METHODS[method].roles:
        why = " (a non-causal method)" if role == "decoder" and method in METHODS else ""
        raise ValueError(f"{role} attention type must be one of {', '.join(methods_for(role))}, got {method!r}{why}")
    if not isinstance(config, AttentionConfig):
        config = AttentionConfig(**(config or {}))
        config.validate()
    return ATTENTION_CLASSES[method](embed_dim, num_heads, causal=causal, cross=cross, dropout=dropout, config=config,
                                     **kw)

"""The plugin's options as fairseq sees them: one dataclass derived from ``linattn.methods``.

Architecture functions call ``check_attention_options(args, ...)``; fairseq runs them right after
parsing, so a bad value stops ``fairseq-train`` before any data is loaded.
"""
import dataclasses
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from linattn.methods import OPTIONS, AttentionConfig, option_type


def _fairseq_field(o):
    kind = ChoiceEnum(list(o.choices)) if o.choices else option_type(o)
    return o.name, kind, dataclasses.field(default=o.default, metadata={"help": o.help})


AttentionOptions = dataclasses.make_dataclass(
    "AttentionOptions", [_fairseq_field(o) for o in OPTIONS.values()], bases=(FairseqDataclass,))
AttentionOptions.__module__ = __name__
AttentionOptions.__doc__ = "fairseq's view of ``linattn.methods.OPTIONS`` (model configs inherit it)."


def check_attention_options(args, *, encoder_layers: Optional[int] = None,
                            decoder_layers: Optional[int] = None) -> AttentionConfig:
    """Validate the plugin's options in ``args`` (see ``AttentionConfig.validate``) and return them typed."""
    config = AttentionConfig.from_args(args)
    config.validate(encoder_layers=encoder_layers, decoder_layers=decoder_layers)
    return config

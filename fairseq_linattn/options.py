"""The plugin's options as fairseq sees them, derived from ``linattn.config.AttentionConfig`` in one place,
and the one function that validates them.

Which path validates what (``check_attention_options`` below is the only caller of ``validate`` on args):

- ``fairseq-train`` and friends: ``options.parse_args_and_arch`` runs the architecture function right after
  parsing; every plugin architecture function (models/*.py) validates, with the model's layer counts, so a bad
  value stops before any data is loaded. For the argparse models (linattn_roberta, linattn_transformer)
  ``fairseq.models.build_model`` runs the architecture function again on every build (checkpoints too).
- ``--arch linattn_lm``: the dataclass model's own architecture, which has no plugin function (and
  ``fairseq.models.build_model`` runs none for it: hydra configs, checkpoints): ``LinAttnLanguageModel.build_model``
  validates, for that architecture only (the others are in ``linattn_lm.ARCHITECTURES``).
- ``build_attention(config=<mapping>)`` from Python: ``AttentionConfig.validate`` there (no layer counts).
- Everything else (build_model of roberta and transformer, the layers, ``build_attention`` with an
  ``AttentionConfig``) reads ``AttentionConfig.from_args`` without validating again.

Validation reads the arguments and never changes them.
"""
import dataclasses
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from linattn.config import AttentionConfig


def fairseq_dataclass(config_class=AttentionConfig, name: str = "AttentionOptions"):
    """``config_class``'s fields as a FairseqDataclass: same names, types, defaults and help; choices as a
    ChoiceEnum."""
    def convert(f):
        choices = f.metadata.get("choices")
        kind = ChoiceEnum(list(choices)) if choices else f.type
        return f.name, kind, dataclasses.field(default=f.default, metadata={"help": f.metadata["help"]})

    cls = dataclasses.make_dataclass(name, [convert(f) for f in dataclasses.fields(config_class)],
                                     bases=(FairseqDataclass,))
    cls.__module__ = __name__
    cls.__doc__ = f"fairseq's view of ``{config_class.__name__}`` (model configs inherit it)."
    return cls


AttentionOptions = fairseq_dataclass()


def check_attention_options(args, *, encoder_layers: Optional[int] = None,
                            decoder_layers: Optional[int] = None) -> AttentionConfig:
    """Validate the plugin's options in ``args`` (see ``AttentionConfig.validate``) and return them typed."""
    config = AttentionConfig.from_args(args)
    config.validate(encoder_layers=encoder_layers, decoder_layers=decoder_layers)
    return config

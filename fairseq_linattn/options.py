"""The plugin's options as fairseq sees them, derived from ``linattn.config.AttentionConfig`` in one place,
and the one function that validates them.

Which path validates what (``check_attention_options`` below is the only caller of ``validate`` on args):

- ``fairseq-train`` and friends: ``options.parse_args_and_arch`` runs the architecture function right after
  parsing; every plugin architecture function (models/*.py) validates, with the model's layer counts, so a bad
  value stops before any data is loaded. For the argparse models (linattn_roberta, linattn_transformer)
  ``fairseq.models.build_model`` runs the architecture function again on every build (checkpoints too).
- ``--arch linattn_lm``: the dataclass model's own architecture. fairseq registers a no-op architecture function
  for it, which ``models/linattn_lm.py`` replaces with one that validates (at parse time, as the others);
  ``fairseq.models.build_model`` runs no architecture function for a dataclass model (hydra configs,
  checkpoints), so ``LinAttnLanguageModel.build_model`` validates too, for that architecture only (the others are
  in ``linattn_lm.ARCHITECTURES``).
- ``build_attention(config=<mapping>)`` from Python: ``AttentionConfig.validate`` there (no layer counts).
- Everything else (build_model of roberta and transformer, the layers, ``build_attention`` with an
  ``AttentionConfig``) reads ``AttentionConfig.from_args`` without validating again.

Validation reads the arguments and never changes them. On the command line (``install_cli_errors``) a bad value
ends the command as argparse ends it for a bad choice: the usage line and one ``fairseq-train: error: ...`` line,
exit status 2; from Python it is an ``AttentionOptionError`` (a ``ValueError``). A fairseq built without the
Cython extensions that training and evaluation call stops there too, with one line saying how to build them.
"""
import dataclasses
import functools
import importlib
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


class AttentionOptionError(ValueError):
    """A plugin option's value or combination is invalid (the message names the option and what is allowed)."""


def check_attention_options(args, *, encoder_layers: Optional[int] = None,
                            decoder_layers: Optional[int] = None) -> AttentionConfig:
    """Validate the plugin's options in ``args`` (see ``AttentionConfig.validate``) and return them typed."""
    config = AttentionConfig.from_args(args)
    try:
        config.validate(encoder_layers=encoder_layers, decoder_layers=decoder_layers)
    except ValueError as err:
        raise AttentionOptionError(str(err)) from None
    return config


# fairseq's compiled extensions the command lines call: (module, what calls it); libbleu only for BLEU scoring
EXTENSIONS = (("fairseq.data.data_utils_fast", "batching"), ("fairseq.data.token_block_utils_fast", "LM blocks"))
BLEU_EXTENSION = ("fairseq.libbleu", "--scoring bleu")
BUILD_HINT = "bash scripts/setup_env.sh builds fairseq with them (or `python setup.py build_ext --inplace` in " \
             "fairseq's source tree)"


def missing_extension(args=None) -> Optional[str]:
    """One line naming the first of fairseq's extensions that ``args``' command needs and cannot import (None if
    all import): the command would otherwise fail with a traceback once data is loaded, or after decoding."""
    wanted = EXTENSIONS + ((BLEU_EXTENSION,) if getattr(args, "scoring", None) == "bleu" else ())
    for module, used_for in wanted:
        try:
            importlib.import_module(module)
        except (ImportError, ValueError) as err:  # ValueError: built against another NumPy
            return (f"fairseq's compiled extension {module} ({used_for}) does not import ({type(err).__name__}: "
                    f"{err}); {BUILD_HINT}")
    return None


def install_cli_errors() -> None:
    """Idempotent: ``fairseq.options.parse_args_and_arch`` (every fairseq command line that loads the plugin)
    reports an ``AttentionOptionError`` as argparse reports a bad choice (``parser.error``: usage, one error line,
    exit 2) and a missing compiled extension in one line (exit 1), before any data is loaded."""
    from fairseq import options

    parse = options.parse_args_and_arch
    if getattr(parse, "linattn_cli_errors", False):
        return

    @functools.wraps(parse)
    def parse_args_and_arch(parser, *args, **kwargs):
        try:
            parsed = parse(parser, *args, **kwargs)
        except AttentionOptionError as err:
            parser.error(str(err))
        missing = missing_extension(parsed[0] if isinstance(parsed, tuple) else parsed)
        if missing:
            parser.exit(1, f"{parser.prog}: error: {missing}\n")
        return parsed

    parse_args_and_arch.linattn_cli_errors = True
    options.parse_args_and_arch = parse_args_and_arch

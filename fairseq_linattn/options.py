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

Beside the values, ``check_attention_options`` refuses an ``--attention-impl`` that cannot run the model's attention
in the run the arguments describe (``check_impl``: e.g. ``fused`` without --fp16/--bf16/--amp, on the CPU or
without Triton), naming the reasons; arguments without the trainer's options (a model's config alone) leave that to
each op call. Validation reads the arguments and never changes them. On the command line (``install_cli_errors``) a
bad value ends the command as argparse ends it for a bad choice: the usage line and one ``fairseq-train: error: ...``
line, exit status 2; from Python it is an ``AttentionOptionError`` (a ``ValueError``). A fairseq built without the
Cython extensions that training and evaluation call stops there too, with one line saying how to build them.
"""
import dataclasses
import functools
import importlib
from typing import Dict, List, Optional, Tuple

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from linattn.config import AttentionConfig
from linattn.methods import layer_types
from linattn.ops.impls import BASE, unsupported_reasons

from .modules.build import ATTENTION_CLASSES


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
    layers = {role: layer_types(getattr(config, f"{role}_attention_type"), n, role)
              for role, n in (("encoder", encoder_layers), ("decoder", decoder_layers)) if n is not None}
    check_impl(args, config, layers)
    check_cuda_graph(args, config)
    return config


def check_cuda_graph(args, config: AttentionConfig) -> None:
    """Refuse ``--attention-cuda-graph`` where the run ``args`` describe cannot capture it: on the CPU, or under
    --amp (autocast's weight cache, which CUDA graphs cannot capture). Only arguments with the trainer's options."""
    if not config.attention_cuda_graph or not hasattr(args, "fp16"):
        return
    device, placed = run_device(args)
    if device != "cuda":
        raise AttentionOptionError(f"--attention-cuda-graph needs CUDA; this run is on the CPU ({placed})")
    if getattr(args, "amp", None):
        raise AttentionOptionError("--attention-cuda-graph cannot capture --amp's autocast (its weight cache); use "
                                   "--fp16 or --bf16")


def run_dtypes(args) -> Tuple[torch.dtype, torch.dtype, str]:
    """The dtype q, k, v reach the ops in, the parameters' dtype, and the arguments that say so. fairseq builds the
    model in float32 and its trainer casts it: float16 with --fp16, bfloat16 with --bf16; --amp keeps it float32 and
    runs the projections under autocast, which gives the ops float16 q, k, v (and LAVO float32 bases)."""
    if getattr(args, "fp16", False):
        return torch.float16, torch.float16, "--fp16"
    if getattr(args, "bf16", False):
        return torch.bfloat16, torch.bfloat16, "--bf16"
    if getattr(args, "amp", False):
        return torch.float16, torch.float32, "--amp: float16 projections, float32 parameters"
    return torch.float32, torch.float32, "no --fp16, --bf16 or --amp"


def run_device(args) -> Tuple[str, str]:
    """The device type the trainer will place the model on, and why: the CPU with --cpu or without CUDA."""
    if getattr(args, "cpu", False):
        return "cpu", "--cpu"
    return ("cuda", "CUDA") if torch.cuda.is_available() else ("cpu", "no CUDA device")


def check_impl(args, config: AttentionConfig, layers: Dict[str, List[str]]) -> None:
    """Refuse ``config.attention_impl`` where it cannot run the self-attention of a layer type of ``layers`` (role ->
    per-layer types) in the run ``args`` describe (``run_dtypes``, ``run_device``, the head size of the role's
    ``*_embed_dim`` / ``*_attention_heads`` where given): the model is built in float32 on the CPU and placed later,
    so a stand-in q on the meta device asks each implementation's ``not_supported_reasons``. Only arguments with
    the trainer's options (``fp16``) are checked; cross-attention runs no choice of implementation."""
    if not hasattr(args, "fp16"):
        return
    dtype, params, precision = run_dtypes(args)
    device, placed = run_device(args)
    problems = []
    for role, types in layers.items():
        embed, heads = getattr(args, f"{role}_embed_dim", None), getattr(args, f"{role}_attention_heads", None)
        q = torch.empty(1, 1, 1, embed // heads if embed and heads else 1, dtype=dtype, device="meta")
        for method in dict.fromkeys(types):
            reasons = unsupported_reasons(method, config.attention_impl, q, causal=role == "decoder", device=device,
                                          **ATTENTION_CLASSES[method].impl_options(config, params))
            if reasons:
                problems.append(f"{method} {role} self-attention: {'; '.join(reasons)}")
    if problems:
        run = f"{str(dtype).replace('torch.', '')} on {device}: {precision}; {placed}"
        raise AttentionOptionError(f"--attention-impl {config.attention_impl} cannot run this run's attention ({run}): "
                                   f"{' | '.join(problems)}; allowed here: {', '.join(('auto',) + BASE)}")


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

"""The plugin's command-line options (one dataclass, reused by every model) and their validation.

Architecture functions call ``validate_attention_options(args)``; fairseq runs them while parsing
the command line, so a bad value stops ``fairseq-train`` before any data is loaded.
"""
from dataclasses import dataclass, field, fields
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..fairseq_compat import bf16_without_xla

METHODS = ("softmax", "lln", "lln_diag", "skyformer", "kernelized", "lavo")
CAUSAL_METHODS = ("softmax", "lln", "lln_diag", "lavo")
CROSS_METHODS = ("softmax", "lavo")

_types_help = (f"one of {{{', '.join(METHODS)}}}, or a comma-separated list with one type per layer "
               "(e.g. softmax,lln,lln)")


@dataclass
class AttentionOptions(FairseqDataclass):
    encoder_attention_type: str = field(default="softmax", metadata={"help": "encoder self-attention: " + _types_help})
    decoder_attention_type: str = field(
        default="softmax", metadata={"help": "decoder (causal) self-attention: " + _types_help.replace(
            "skyformer, kernelized, ", "") + "; skyformer and kernelized are non-causal"})
    cross_attention_type: ChoiceEnum(CROSS_METHODS) = field(
        default="softmax", metadata={"help": "encoder-decoder attention (linattn_transformer)"})
    lln_moment_matching: ChoiceEnum(["paper", "fit", "exact", "off"]) = field(
        default="paper", metadata={"help": "how LLN sets alpha, beta (LLN §4.1): paper = published a, b; "
                                           "fit = a, b from --lln-constants-file (written by "
                                           "`python -m fairseq_linattn.ops.moment_matching fit`); exact = "
                                           "interpolated variance table; off = fixed --lln-alpha/--lln-beta"})
    lln_alpha: Optional[float] = field(default=None, metadata={
        "help": "fixed LLN alpha (with --lln-beta turns moment matching off; the LLN A.8.4 ablation)"})
    lln_beta: Optional[float] = field(default=None, metadata={"help": "fixed LLN beta (see --lln-alpha)"})
    lln_constants_file: Optional[str] = field(default=None, metadata={
        "help": "JSON with the a, b constants for --lln-moment-matching fit"})
    lln_stats: ChoiceEnum(["auto", "batch", "ema"]) = field(default="auto", metadata={
        "help": "statistics for moment matching: batch (current batch; encoder default), ema (running "
                "average from earlier batches; decoder default, the only causal-safe choice), auto"})
    lln_stats_per_head: bool = field(default=False, metadata={"help": "moment matching per head, not per layer"})
    lln_ema_momentum: float = field(default=0.99, metadata={"help": "EMA momentum for --lln-stats ema"})
    lln_max_scale: float = field(default=8.0, metadata={"help": "upper clamp for alpha and beta"})
    lln_chunk_size: int = field(default=64, metadata={"help": "chunk size of causal LLN"})
    lln_diag_block_size: int = field(default=64, metadata={"help": "block size of LLN+Diag's softmax blocks"})
    lln_diag_mix: ChoiceEnum(["average", "learnable_scale", "learnable_ratio"]) = field(
        default="average", metadata={"help": "how LLN+Diag mixes its two parts"})
    skyformer_landmarks: int = field(default=128, metadata={"help": "Skyformer Nyström landmarks"})
    skyformer_landmark_mode: ChoiceEnum(["stratified", "uniform"]) = field(
        default="stratified", metadata={"help": "stratified: half from Q, half from K rows; uniform: over [Q; K]"})
    skyformer_exact_inverse: bool = field(default=False, metadata={
        "help": "pseudo-inverse instead of the 6-step iteration (analysis, tests)"})
    lavo_window: int = field(default=64, metadata={"help": "LAVO local window w"})
    lavo_bases: Optional[int] = field(default=None, metadata={"help": "LAVO orthogonal bases r (default: head dim)"})
    lavo_freeze_bases: bool = field(default=False, metadata={"help": "keep LAVO's orthogonal bases fixed"})
    lavo_token_positions: bool = field(default=False, metadata={
        "help": "keep token position embeddings in an all-LAVO LM (LAVO §4.1 drops them: relative bias only)"})
    attention_stats_interval: int = field(default=0, metadata={
        "help": "log attention entropy / spectral gap every K updates (0 = off)"})


OPTION_NAMES = [f.name for f in fields(AttentionOptions) if not f.name.startswith("_")]


def set_attention_defaults(args) -> None:
    """Fill missing plugin options with their defaults (architecture functions call this)."""
    for f in fields(AttentionOptions):
        if not f.name.startswith("_") and getattr(args, f.name, None) is None:
            setattr(args, f.name, f.default)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def layer_types(spec: str, num_layers: int, option: str, allowed=METHODS) -> List[str]:
    """'lln' -> ['lln'] * L; 'softmax,lln' -> per layer. ValueError names the option and the allowed values."""
    types = [t.strip() for t in str(spec).split(",")]
    for t in types:
        if t not in allowed:
            extra = ""
            if t in METHODS:
                extra = f" ('{t}' is a non-causal method and cannot be causal decoder self-attention)"
            raise ValueError(f"{_flag(option)}: invalid attention type '{t}'{extra}; "
                             f"allowed: {', '.join(allowed)}, or a comma list of them")
    if len(types) == 1:
        return types * num_layers
    if len(types) != num_layers:
        raise ValueError(f"{_flag(option)}: got {len(types)} types ({spec}) for {num_layers} layers; "
                         f"give one type, or exactly one per layer")
    return types


def validate_attention_options(args, *, encoder_layers: Optional[int] = None,
                               decoder_layers: Optional[int] = None) -> None:
    """Check every plugin option; raise ValueError naming the option and the allowed values.

    Called by every architecture function (fairseq runs those right after parsing), which also
    makes ``--bf16`` usable without torch_xla (see fairseq_compat.bf16_without_xla).
    """
    bf16_without_xla(args)
    set_attention_defaults(args)
    if encoder_layers is not None:
        layer_types(args.encoder_attention_type, encoder_layers, "encoder_attention_type")
    if decoder_layers is not None:
        dec = layer_types(args.decoder_attention_type, decoder_layers, "decoder_attention_type", CAUSAL_METHODS)
        if "lln" in " ".join(dec) and args.lln_stats == "batch":
            raise ValueError("--lln-stats batch would let a causal decoder see statistics of future tokens "
                             "and other sequences; use --lln-stats ema (or auto) for decoders")
    if args.cross_attention_type not in CROSS_METHODS:
        raise ValueError(f"--cross-attention-type: allowed: {', '.join(CROSS_METHODS)}; got {args.cross_attention_type}")
    positive_ints = ("lln_chunk_size", "lln_diag_block_size", "skyformer_landmarks", "lavo_window")
    for name in positive_ints:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
    if args.lavo_bases is not None and args.lavo_bases < 1:
        raise ValueError(f"--lavo-bases must be an integer >= 1 (and <= head dim), got {args.lavo_bases!r}")
    if (args.lln_alpha is None) != (args.lln_beta is None):
        raise ValueError("--lln-alpha and --lln-beta must be given together (fixed alpha, beta turn moment "
                         "matching off)")
    for name in ("lln_alpha", "lln_beta", "lln_max_scale"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"{_flag(name)} must be > 0, got {value!r}")
    if args.lln_alpha is not None:
        args.lln_moment_matching = "off"
    elif args.lln_moment_matching == "off":
        raise ValueError("--lln-moment-matching off needs fixed --lln-alpha and --lln-beta")
    if args.lln_moment_matching == "fit" and not args.lln_constants_file:
        raise ValueError("--lln-moment-matching fit needs --lln-constants-file (a JSON written by "
                         "`python -m fairseq_linattn.ops.moment_matching fit`)")
    if args.lln_constants_file and args.lln_moment_matching != "fit":
        raise ValueError("--lln-constants-file is read only with --lln-moment-matching fit")
    if not 0.0 <= args.lln_ema_momentum < 1.0:
        raise ValueError(f"--lln-ema-momentum must be in [0, 1), got {args.lln_ema_momentum!r}")
    if args.attention_stats_interval < 0:
        raise ValueError(f"--attention-stats-interval must be >= 0, got {args.attention_stats_interval!r}")

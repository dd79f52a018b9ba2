"""The plugin's options as one hand-written, frozen dataclass: ``AttentionConfig``.

Each field carries its default, help, allowed choices and value check once, in its metadata
(``option(...)``); which methods read a field is ``Method.options`` in ``linattn.methods``.
fairseq's dataclass (``fairseq_linattn/options.py``), the README's options table and validation
all derive from these fields. Pure Python: no torch, no fairseq.
"""
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

from linattn.implementations import IMPLS
from linattn.methods import METHODS, flag, layer_types, methods_for


def _positive_int(value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be an integer >= 1, got {value!r}"
    return None


def _optional_positive_int(value) -> Optional[str]:
    return None if value is None else _positive_int(value)


def _optional_positive(value) -> Optional[str]:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return f"must be > 0, got {value!r}"
    return None


def _non_negative_int(value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"must be an integer >= 0, got {value!r}"
    return None


def _unit_interval(value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        return f"must be in [0, 1), got {value!r}"
    return None


def option(default: Any, help: str, *, choices: Optional[Tuple[str, ...]] = None,
           check: Optional[Callable[[Any], Optional[str]]] = None):
    """A field of ``AttentionConfig``: the flag ``flag(name)``'s default, help, allowed values, value check
    (value -> error text, None if valid)."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


def _types_help(role: str) -> str:
    others = [n for n in METHODS if n not in methods_for(role)]
    text = (f"one of {{{', '.join(methods_for(role))}}}, or a comma-separated list with one type per layer "
            "(e.g. softmax,lln,lln)")
    return text + (f"; {', '.join(others)} cannot be causal" if others else "")


@dataclass(frozen=True)
class AttentionConfig:
    """The plugin's options as one typed, immutable object. Modules read it; ``validate`` checks it."""

    # -- every model
    encoder_attention_type: str = option("softmax", "encoder self-attention: " + _types_help("encoder"))
    decoder_attention_type: str = option("softmax", "decoder (causal) self-attention: " + _types_help("decoder"))
    cross_attention_type: str = option(
        "softmax", "encoder-decoder attention of linattn_transformer (LAVO §3.4 for lavo)",
        choices=tuple(methods_for("cross")))
    attention_stats_interval: int = option(0, "log attention entropy / spectral gap every K updates (0 = off)",
                                           check=_non_negative_int)
    attention_impl: str = option(
        "auto", "implementation of the attention ops: parallel = a fixed number of batched tensor ops whatever the "
        "length (GPU-shaped); looped = passes over cache-sized chunks (the fast CPU implementation); fused = Triton "
        "kernels where a method has them (LLN, LLN+Diag, Skyformer, LAVO self-attention; the faster choice for causal "
        "LLN on an H100), else parallel: half inputs on CUDA (--fp16 or --bf16; --amp but for LAVO, whose bases stay "
        "float32), a run they cannot take is refused with the reasons; auto = looped on the CPU, parallel on any "
        "other device and under --attention-compile",
        choices=IMPLS)
    attention_compile: bool = option(
        False, "compile each attention's op call with torch.compile (batch and lengths dynamic, heads and head size "
        "fixed; torch >= 2.11): fused Triton kernels on a GPU, C++ on the CPU; the first batch pays the compile time "
        "(a batch of one: its own)")
    attention_compile_check: str = option(
        "first-step", "with --attention-compile: first-step = each module's first training step also runs eagerly "
        "and training stops if the compiled output or a gradient differs (one extra step per module and run); "
        "off = no check", choices=("first-step", "off"))
    attention_cuda_graph: bool = option(
        False, "capture each attention module's training step (forward and backward) in CUDA graphs, once per input "
        "shape (at most 4 a module), and replay them: the host issues a module's step as two graph launches "
        "(CUDA, --fp16 or --bf16; a step the graphs cannot hold runs eagerly, the reason logged once)")
    # -- LLN and LLN+Diag
    lln_moment_matching: str = option(
        "paper", "how LLN sets alpha, beta (LLN §4.1): paper = published a, b; fit = a, b from "
        "--lln-constants-file (written by `python -m linattn_tools.fit_moments`); exact = interpolated variance "
        "table; off = fixed --lln-alpha/--lln-beta (implied by giving them)",
        choices=("paper", "fit", "exact", "off"))
    lln_alpha: Optional[float] = option(
        None, "fixed LLN alpha (with --lln-beta turns moment matching off; the LLN A.8.4 ablation)",
        check=_optional_positive)
    lln_beta: Optional[float] = option(None, "fixed LLN beta (see --lln-alpha)", check=_optional_positive)
    lln_constants_file: Optional[str] = option(None, "JSON with the a, b constants for --lln-moment-matching fit")
    lln_stats: str = option(
        "auto", "statistics for moment matching: batch (current batch in training, their running average in eval; "
        "encoder default), ema (running average from earlier batches; decoder default, the only causal-safe "
        "choice), auto",
        choices=("auto", "batch", "ema"))
    lln_stats_per_head: bool = option(False, "moment matching per head, not per layer")
    lln_ema_momentum: float = option(0.99, "EMA momentum for --lln-stats ema and batch's eval statistics",
                                    check=_unit_interval)
    lln_max_scale: float = option(8.0, "upper clamp for alpha and beta", check=_optional_positive)
    lln_chunk_size: int = option(64, "chunk size of causal LLN", check=_positive_int)
    # -- LLN+Diag
    lln_diag_block_size: int = option(64, "block size of LLN+Diag's softmax blocks", check=_positive_int)
    lln_diag_mix: str = option(
        "average", "how LLN+Diag mixes its two parts: average (0.5/0.5), learnable_scale (r·LLN + p·Diag, per "
        "head and channel, init 0.5), learnable_ratio (r·LLN + (1−r)·Diag)",
        choices=("average", "learnable_scale", "learnable_ratio"))
    # -- Skyformer
    skyformer_landmarks: int = option(128, "Skyformer Nyström landmarks", check=_positive_int)
    skyformer_landmark_mode: str = option(
        "stratified", "stratified: half from Q, half from K rows; uniform: over [Q; K]",
        choices=("stratified", "uniform"))
    skyformer_exact_inverse: bool = option(False, "pseudo-inverse instead of the 6-step iteration (analysis, tests)")
    # -- LAVO
    lavo_window: int = option(64, "LAVO local window w", check=_positive_int)
    lavo_bases: Optional[int] = option(None, "LAVO orthogonal bases r (default: head dim; at most head dim)",
                                       check=_optional_positive_int)
    lavo_freeze_bases: bool = option(False, "keep LAVO's orthogonal bases fixed")
    lavo_token_positions: bool = option(
        False, "keep token position embeddings in an all-LAVO LM (LAVO §4.1 drops them: relative bias only)")

    @classmethod
    def from_args(cls, args) -> "AttentionConfig":
        """The plugin's options of an argparse Namespace, DictConfig or TransformerConfig; a missing or None
        value takes its default. Reads ``args`` only."""
        values = {}
        for f in fields(cls):
            value = getattr(args, f.name, None)
            if value is not None and f.metadata["choices"] is not None:
                value = str(value)  # fairseq's ChoiceEnum members are str-like enums
            values[f.name] = f.default if value is None else value
        return cls(**values)

    @property
    def moment_matching(self) -> str:
        """LLN's effective mode: fixed --lln-alpha/--lln-beta imply 'off'."""
        return "off" if self.lln_alpha is not None else self.lln_moment_matching

    def validate(self, *, encoder_layers: Optional[int] = None, decoder_layers: Optional[int] = None) -> None:
        """Check every value and the rules between them; ValueError names the option and the allowed values.

        ``encoder_layers`` / ``decoder_layers``: the model's layer counts, to check per-layer type lists.
        Reads only; fairseq_linattn/options.py says which code path calls it.
        """
        for f in fields(self):
            value, choices, check = getattr(self, f.name), f.metadata["choices"], f.metadata["check"]
            if choices is not None and value not in choices:
                raise ValueError(f"{flag(f.name)}: allowed: {', '.join(choices)}; got {value!r}")
            error = check(value) if check is not None else None
            if error:
                raise ValueError(f"{flag(f.name)} {error}")
        if self.attention_compile and self.attention_impl == "looped":
            raise ValueError("--attention-compile runs --attention-impl auto, parallel or fused, not looped (its "
                             "Python loops over working passes would be unrolled into the compiled graph)")
        if self.attention_cuda_graph and self.attention_compile:
            raise ValueError("--attention-cuda-graph and --attention-compile: choose one (a compiled call's guards and "
                             "first-step check run on the host at every call, which a captured step skips)")
        layers: Dict[str, List[str]] = {}
        if encoder_layers is not None:
            layers["encoder"] = layer_types(self.encoder_attention_type, encoder_layers, "encoder")
        if decoder_layers is not None:
            layers["decoder"] = layer_types(self.decoder_attention_type, decoder_layers, "decoder")
        layers["cross"] = layer_types(self.cross_attention_type, 1, "cross")
        for method in METHODS.values():
            if method.check is not None:
                method.check(self, layers)


def _check_ownership() -> None:
    """Every option a method reads is a field."""
    names = {f.name for f in fields(AttentionConfig)}
    for method in METHODS.values():
        unknown = set(method.options) - names
        if unknown:
            raise AssertionError(f"method {method.name} reads unknown options {sorted(unknown)}")


_check_ownership()


def options_table() -> str:
    """The README's options table (Markdown), one row per option; a test keeps the README in step."""
    rows = ["| option | default | read by | meaning |", "|---|---|---|---|"]
    for f in fields(AttentionConfig):
        readers = ", ".join(m.name for m in METHODS.values() if f.name in m.options) or "every model"
        rows.append(f"| `{flag(f.name)}` | `{f.default}` | {readers} | {f.metadata['help']} |")
    return "\n".join(rows)

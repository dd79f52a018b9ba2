"""The attention methods, each declared once: its module class, roles, options and FLOP count.

Everything that lists methods or options derives from ``METHODS`` and ``OPTIONS``: fairseq's option
dataclass and choices (``modules/options.py``), validation (``AttentionConfig.validate``), the
modules' typed options (``AttentionConfig``), the recipe scripts' check
(``python -m linattn.methods check``), the benchmarks and the README's options table
(docs/design.md §9 says how to add a method). Pure Python: no torch, no fairseq.

    python -m linattn.methods check --role encoder|decoder|cross TYPES  # exit 2 on a bad type
    python -m linattn.methods list [--role ROLE]                        # one name per line
    python -m linattn.methods options-table                              # the README's table
"""
import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROLES = ("encoder", "decoder", "cross")  # non-causal self-attention, causal self-attention, encoder-decoder
ROLE_OPTIONS = {"encoder": "encoder_attention_type", "decoder": "decoder_attention_type",
                "cross": "cross_attention_type"}


def flag(name: str) -> str:
    """lln_chunk_size -> --lln-chunk-size."""
    return "--" + name.replace("_", "-")


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


@dataclass(frozen=True)
class Option:
    """One command-line option: ``flag(name)``, its default, help, allowed values and value check."""

    name: str
    default: Any
    help: str
    type: Any = None  # the value's Python type (default: type(default))
    choices: Optional[Tuple[str, ...]] = None
    check: Optional[Callable[[Any], Optional[str]]] = None  # value -> error text, None if valid


@dataclass(frozen=True)
class Method:
    """An attention method: the module class that implements it, where it can be used, what it reads."""

    name: str
    title: str  # for tables and plots
    module_class: str  # class name in fairseq_linattn.modules.attention
    roles: Tuple[str, ...]
    options: Tuple[Option, ...] = ()  # the options this method reads (shared ones are in SHARED_OPTIONS)
    flops: Callable[..., float] = None  # (n, d, causal, cfg) -> matmul FLOPs of one forward per (batch, head)
    relative_positions: bool = False  # positions come from the attention itself (token positions dropped)
    check: Optional[Callable[["AttentionConfig", Dict[str, List[str]]], None]] = None  # cross-option rules
    rows_note: str = ""  # what the module's ``attention_rows`` is, in a few words (the analysis reports it per layer)
    colour: str = "black"  # the analysis plots' colour for this method's layers
    rounding_gain: float = 1.0  # how much more than an exact op the output may round in half precision


# -- the options ------------------------------------------------------------------------------
LLN_OPTIONS = (
    Option("lln_moment_matching", "paper", "how LLN sets alpha, beta (LLN §4.1): paper = published a, b; "
           "fit = a, b from --lln-constants-file (written by `python -m linattn_tools.fit_moments`); "
           "exact = interpolated variance table; off = fixed --lln-alpha/--lln-beta (implied by giving them)",
           choices=("paper", "fit", "exact", "off")),
    Option("lln_alpha", None, "fixed LLN alpha (with --lln-beta turns moment matching off; the LLN A.8.4 "
           "ablation)", type=Optional[float], check=_optional_positive),
    Option("lln_beta", None, "fixed LLN beta (see --lln-alpha)", type=Optional[float], check=_optional_positive),
    Option("lln_constants_file", None, "JSON with the a, b constants for --lln-moment-matching fit",
           type=Optional[str]),
    Option("lln_stats", "auto", "statistics for moment matching: batch (current batch; encoder default), ema "
           "(running average from earlier batches; decoder default, the only causal-safe choice), auto",
           choices=("auto", "batch", "ema")),
    Option("lln_stats_per_head", False, "moment matching per head, not per layer"),
    Option("lln_ema_momentum", 0.99, "EMA momentum for --lln-stats ema", check=_unit_interval),
    Option("lln_max_scale", 8.0, "upper clamp for alpha and beta", check=_optional_positive),
    Option("lln_chunk_size", 64, "chunk size of causal LLN", check=_positive_int),
)
LLN_DIAG_OPTIONS = (
    Option("lln_diag_block_size", 64, "block size of LLN+Diag's softmax blocks", check=_positive_int),
    Option("lln_diag_mix", "average", "how LLN+Diag mixes its two parts: average (0.5/0.5), learnable_scale "
           "(r·LLN + p·Diag, per head and channel, init 0.5), learnable_ratio (r·LLN + (1−r)·Diag)",
           choices=("average", "learnable_scale", "learnable_ratio")),
)
SKYFORMER_OPTIONS = (
    Option("skyformer_landmarks", 128, "Skyformer Nyström landmarks", check=_positive_int),
    Option("skyformer_landmark_mode", "stratified", "stratified: half from Q, half from K rows; uniform: "
           "over [Q; K]", choices=("stratified", "uniform")),
    Option("skyformer_exact_inverse", False, "pseudo-inverse instead of the 6-step iteration (analysis, tests)"),
)
LAVO_OPTIONS = (
    Option("lavo_window", 64, "LAVO local window w", check=_positive_int),
    Option("lavo_bases", None, "LAVO orthogonal bases r (default: head dim; at most head dim)",
           type=Optional[int], check=_optional_positive_int),
    Option("lavo_freeze_bases", False, "keep LAVO's orthogonal bases fixed"),
    Option("lavo_token_positions", False, "keep token position embeddings in an all-LAVO LM (LAVO §4.1 drops "
           "them: relative bias only)"),
)


# -- FLOPs: matmul FLOPs of one forward per (batch, head); a multiply-add is 2 FLOPs; exp, softmax and
# masks are left out (linattn_tools/benchmark/flops.py); a backward costs two matmuls per forward one -
def _lln_flops(n: int, d: int, causal: bool, cfg) -> float:
    if not causal:  # S = phi_k^T [V, 1] and phi_q S (LLN eq. 8-9)
        return 4 * n * d * (d + 1)
    c = min(cfg.lln_chunk_size, n)  # per chunk: phi_q phi_k^T and W [V, 1], the state, queries vs state
    return -(-n // c) * (2 * c * c * (2 * d + 1) + 4 * c * d * (d + 1))


def block_softmax_flops(n: int, d: int, block_size: int) -> float:
    """Softmax inside diagonal blocks (full blocks, causal ones included): 4 N bs D."""
    bs = min(block_size, n)
    return 4 * (-(-n // bs)) * bs * bs * d


def _lavo_flops(n: int, d: int, causal: bool, cfg) -> float:
    w, r = cfg.lavo_window, cfg.lavo_bases or d
    nw = -(-n // w) * w  # padded to whole windows; causal reads its own and the previous window
    return (8 if causal else 4) * nw * w * d + 6 * nw * r * d  # local; x B^T, q B^T and the read-out


def _skyformer_flops(n: int, d: int, causal: bool, cfg) -> float:
    m = min(cfg.skyformer_landmarks, 2 * n)  # C_Q, C_K, C_K^T V, C_Q (.); M, M^-1 products; 6 Newton-Schulz steps
    return 8 * n * m * d + 4 * m * m * d + 48 * m ** 3


def _check_lln(cfg: "AttentionConfig", layers: Dict[str, List[str]]) -> None:
    """LLN's rules between options (LLN §4.1; docs/design.md §3.1)."""
    if (cfg.lln_alpha is None) != (cfg.lln_beta is None):
        raise ValueError("--lln-alpha and --lln-beta must be given together (fixed alpha, beta turn moment "
                         "matching off)")
    if cfg.lln_alpha is None and cfg.lln_moment_matching == "off":
        raise ValueError("--lln-moment-matching off needs fixed --lln-alpha and --lln-beta")
    if cfg.lln_moment_matching == "fit" and not cfg.lln_constants_file:
        raise ValueError("--lln-moment-matching fit needs --lln-constants-file (a JSON written by "
                         "`python -m linattn_tools.fit_moments`)")
    if cfg.lln_constants_file and cfg.lln_moment_matching != "fit":
        raise ValueError("--lln-constants-file is read only with --lln-moment-matching fit")
    if cfg.lln_stats == "batch" and any(t in ("lln", "lln_diag") for t in layers.get("decoder", ())):
        raise ValueError("--lln-stats batch would let a causal decoder see statistics of future tokens "
                         "and other sequences; use --lln-stats ema (or auto) for decoders")


METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("softmax", "softmax", "SoftmaxAttention", ("encoder", "decoder", "cross"),
           flops=lambda n, d, causal, cfg: (2 if causal else 4) * n * n * d,  # Q K^T and P V (causal: half)
           rows_note="exact: P V is the output"),
    Method("lln", "LLN", "LLNAttention", ("encoder", "decoder"), LLN_OPTIONS, flops=_lln_flops, check=_check_lln,
           rows_note="exact: P V is the output", colour="tab:blue"),
    Method("lln_diag", "LLN+Diag", "LLNDiagAttention", ("encoder", "decoder"), LLN_OPTIONS + LLN_DIAG_OPTIONS,
           flops=lambda n, d, causal, cfg: _lln_flops(n, d, causal, cfg) + block_softmax_flops(
               n, d, cfg.lln_diag_block_size), check=_check_lln,
           rows_note="exact for mix 'average'; head-mean mix weights otherwise", colour="tab:purple"),
    Method("skyformer", "Skyformer", "SkyformerAttention", ("encoder",), SKYFORMER_OPTIONS, flops=_skyformer_flops,
           rows_note="Nyström kernel rows (eval landmarks), negatives clipped, normalised to sum 1",
           colour="tab:brown",
           rounding_gain=10.0),  # the Nyström (pseudo-)inverse amplifies half-precision rounding
    Method("kernelized", "Kernelized", "KernelizedAttention", ("encoder",),
           flops=lambda n, d, causal, cfg: 4 * n * n * d,  # the full Gaussian kernel and C V
           rows_note="kernel rows normalised to sum 1 (the kernel itself is not row-stochastic)", colour="tab:red"),
    Method("lavo", "LAVO", "LAVOAttention", ("encoder", "decoder", "cross"), LAVO_OPTIONS, flops=_lavo_flops,
           relative_positions=True,
           rows_note="token mixing 0.5 (local + memory mean); values also pass a per-query channel projection",
           colour="tab:olive"),
)}


def methods_for(role: str) -> List[str]:
    """Names of the methods usable in ``role`` (encoder, decoder or cross), in declaration order."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return [name for name, m in METHODS.items() if role in m.roles]


def _types_help(role: str) -> str:
    others = [n for n in METHODS if n not in methods_for(role)]
    text = (f"one of {{{', '.join(methods_for(role))}}}, or a comma-separated list with one type per layer "
            "(e.g. softmax,lln,lln)")
    return text + (f"; {', '.join(others)} cannot be causal" if others else "")


SHARED_OPTIONS = (
    Option("encoder_attention_type", "softmax", "encoder self-attention: " + _types_help("encoder")),
    Option("decoder_attention_type", "softmax", "decoder (causal) self-attention: " + _types_help("decoder")),
    Option("cross_attention_type", "softmax", "encoder-decoder attention of linattn_transformer (LAVO §3.4 for "
           "lavo)",
           choices=tuple(methods_for("cross"))),
    Option("attention_stats_interval", 0, "log attention entropy / spectral gap every K updates (0 = off)",
           check=_non_negative_int),
)


def _all_options() -> Dict[str, Option]:
    options = {o.name: o for o in SHARED_OPTIONS}
    for method in METHODS.values():
        for o in method.options:
            if options.setdefault(o.name, o) is not o:
                raise AssertionError(f"option {o.name} is declared twice with different values")
    return options


OPTIONS: Dict[str, Option] = _all_options()


def option_type(o: Option):
    return o.type if o.type is not None else type(o.default)


def layer_types(spec: str, num_layers: int, role: str) -> List[str]:
    """'lln' -> ['lln'] * L; 'softmax,lln' -> per layer. ValueError names the option and the allowed values."""
    option, allowed = flag(ROLE_OPTIONS[role]), methods_for(role)
    types = [t.strip() for t in str(spec).split(",")]
    for t in types:
        if t not in allowed:
            extra = ""
            if t in METHODS:
                extra = (f" ('{t}' is a non-causal method and cannot be causal decoder self-attention)"
                         if role == "decoder" else f" ('{t}' has no {role}-attention form)")
            raise ValueError(f"{option}: invalid attention type '{t}'{extra}; allowed: {', '.join(allowed)}"
                             + (", or a comma list of them" if role != "cross" else ""))
    if role == "cross" and len(types) != 1:
        raise ValueError(f"{option}: one type for every layer, got {spec}")
    if len(types) == 1:
        return types * num_layers
    if len(types) != num_layers:
        raise ValueError(f"{option}: got {len(types)} types ({spec}) for {num_layers} layers; "
                         f"give one type, or exactly one per layer")
    return types


class _ConfigMethods:
    """What AttentionConfig adds to its generated fields."""

    @classmethod
    def from_args(cls, args) -> "AttentionConfig":
        """The plugin's options of an argparse Namespace, DictConfig or TransformerConfig; a missing or None
        value takes its default. Reads ``args`` only."""
        values = {}
        for name, o in OPTIONS.items():
            value = getattr(args, name, None)
            if value is not None and o.choices is not None:
                value = str(value)  # fairseq's ChoiceEnum members are str-like enums
            values[name] = o.default if value is None else value
        return cls(**values)

    @property
    def moment_matching(self) -> str:
        """LLN's effective mode: fixed --lln-alpha/--lln-beta imply 'off'."""
        return "off" if self.lln_alpha is not None else self.lln_moment_matching

    def validate(self, *, encoder_layers: Optional[int] = None, decoder_layers: Optional[int] = None) -> None:
        """Check every value and the rules between them; ValueError names the option and the allowed values.

        ``encoder_layers`` / ``decoder_layers``: the model's layer counts, to check per-layer type lists.
        """
        for name, o in OPTIONS.items():
            value = getattr(self, name)
            if o.choices is not None and value not in o.choices:
                raise ValueError(f"{flag(name)}: allowed: {', '.join(o.choices)}; got {value!r}")
            error = o.check(value) if o.check is not None else None
            if error:
                raise ValueError(f"{flag(name)} {error}")
        layers = {}
        if encoder_layers is not None:
            layers["encoder"] = layer_types(self.encoder_attention_type, encoder_layers, "encoder")
        if decoder_layers is not None:
            layers["decoder"] = layer_types(self.decoder_attention_type, decoder_layers, "decoder")
        layers["cross"] = layer_types(self.cross_attention_type, 1, "cross")
        for method in METHODS.values():
            if method.check is not None:
                method.check(self, layers)


AttentionConfig = dataclasses.make_dataclass(
    "AttentionConfig",
    [(name, option_type(o), field(default=o.default, metadata={"help": o.help})) for name, o in OPTIONS.items()],
    bases=(_ConfigMethods,), frozen=True)
AttentionConfig.__module__ = __name__
AttentionConfig.__doc__ = ("The plugin's options as one typed, immutable object (fields: ``OPTIONS``). Modules "
                           "read it; ``validate`` checks it.")


def options_table() -> str:
    """The README's options table (Markdown), one row per option; a test keeps the README in step."""
    rows = ["| option | default | read by | meaning |", "|---|---|---|---|"]
    for name, o in OPTIONS.items():
        readers = ", ".join(m.name for m in METHODS.values() if o in m.options) or "every model"
        rows.append(f"| `{flag(name)}` | `{o.default}` | {readers} | {o.help} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linattn.methods", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="exit 2 with a message unless TYPES is a valid attention type (or comma list) for ROLE")
    check.add_argument("--role", choices=ROLES, required=True)
    check.add_argument("types", help="a method name, or a comma list with one type per layer")
    listing = sub.add_parser("list", help="the methods, one per line")
    listing.add_argument("--role", choices=ROLES)
    sub.add_parser("options-table", help="the README's options table")
    args = parser.parse_args(argv)
    if args.command == "check":
        types = [t.strip() for t in args.types.split(",")]
        try:
            layer_types(args.types, len(types), args.role)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.command == "list":
        print("\n".join(methods_for(args.role) if args.role else METHODS))
    else:
        print(options_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

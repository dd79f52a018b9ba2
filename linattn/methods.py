"""The attention methods, each declared once: its module class, roles, options, FLOP count, benchmark call.

Everything that lists methods derives from ``METHODS``: the modules, validation (``AttentionConfig.validate``
in linattn/config.py, which declares the options), the recipe scripts' check
(``python -m linattn.methods check``), the benchmarks (with ``BENCHMARK_EXTRAS``) and the README's options
table (docs/design.md §9 says how to add a method). Pure Python: no torch, no fairseq (the benchmark calls
get the ops module as an argument).

    python -m linattn.methods check --role encoder|decoder|cross TYPES  # exit 2 on a bad type
    python -m linattn.methods list [--role ROLE]                        # one name per line
    python -m linattn.methods options-table                              # the README's table
"""
import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # linattn/config.py imports this module
    from linattn.config import AttentionConfig

ROLES = ("encoder", "decoder", "cross")  # non-causal self-attention, causal self-attention, encoder-decoder
ROLE_OPTIONS = {"encoder": "encoder_attention_type", "decoder": "decoder_attention_type",
                "cross": "cross_attention_type"}


def flag(name: str) -> str:
    """lln_chunk_size -> --lln-chunk-size."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Method:
    """An attention method: the module class that implements it, where it can be used, what it reads, how the
    benchmarks call its op."""

    name: str
    title: str  # for tables and plots
    module_class: str  # class name in fairseq_linattn.modules (its file imported by modules/build.py)
    roles: Tuple[str, ...]
    options: Tuple[str, ...] = ()  # AttentionConfig fields this method reads (the shared ones: every model)
    flops: Callable[..., float] = None  # (n, d, causal, cfg) -> matmul FLOPs of one forward per (batch, head)
    relative_positions: bool = False  # positions come from the attention itself (token positions dropped)
    check: Optional[Callable[["AttentionConfig", Dict[str, List[str]]], None]] = None  # cross-option rules
    rows_note: str = ""  # what the module's ``attention_rows`` is, in a few words (the analysis reports it per layer)
    colour: str = "black"  # the analysis plots' colour for this method's layers
    rounding_gain: float = 1.0  # how much more than an exact op the output may round in half precision
    # (ops, q, k, v, causal, x) -> output: the benchmarks' call of its op (``ops``: linattn.ops or an earlier
    # copy of it); ``x``: alpha, beta, chunk_size, block_size, window, landmarks, lavo_bases, lavo_bias
    benchmark_op: Optional[Callable[..., Any]] = None
    benchmark_params: Tuple[str, ...] = ()  # keys of ``x`` the benchmarks also take the gradient for
    quadratic: bool = False  # N x N time: an exact method (the op benchmark's FLOP-floor table lists the others)
    dropout_keeps_matrix: bool = False  # with attention dropout it stores the N x N probabilities

    @property
    def causal(self) -> bool:
        """Has a causal (decoder self-attention) form."""
        return "decoder" in self.roles


@dataclass(frozen=True)
class BenchmarkOp:
    """An op the benchmarks time beside the methods' without being a method (fields as in ``Method``)."""

    name: str
    title: str
    flops: Callable[..., float]
    benchmark_op: Callable[..., Any]
    causal: bool = True
    benchmark_params: Tuple[str, ...] = ()
    quadratic: bool = False


# -- the options each method reads (declared with their defaults and help in linattn/config.py) -----------
LLN_OPTIONS = ("lln_moment_matching", "lln_alpha", "lln_beta", "lln_constants_file", "lln_stats",
               "lln_stats_per_head", "lln_ema_momentum", "lln_max_scale", "lln_chunk_size")
LLN_DIAG_OPTIONS = ("lln_diag_block_size", "lln_diag_mix")
SKYFORMER_OPTIONS = ("skyformer_landmarks", "skyformer_landmark_mode", "skyformer_exact_inverse")
LAVO_OPTIONS = ("lavo_window", "lavo_bases", "lavo_freeze_bases", "lavo_token_positions")


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


# -- how the benchmarks call each op (linattn_tools/benchmark: attention, compare_ops) ------------------
def _form(x) -> Dict[str, str]:
    """The ``impl`` argument when the benchmark chose one (compare_ops also calls ops of revisions without it)."""
    return {"impl": x["impl"]} if "impl" in x else {}


def _bench_lln(ops, q, k, v, causal, x):
    return ops.lln_attention(q, k, v, x["alpha"], x["beta"], causal=causal, chunk_size=x["chunk_size"],
                             **_form(x))


def _bench_lln_diag(ops, q, k, v, causal, x):
    return ops.lln_diag_attention(q, k, v, x["alpha"], x["beta"], causal=causal, chunk_size=x["chunk_size"],
                                  block_size=x["block_size"], **_form(x))


def _bench_skyformer(ops, q, k, v, causal, x):  # training-mode landmarks (redrawn per call); never causal
    return ops.skyformer_attention(q, k, v, num_landmarks=x["landmarks"], training=True, **_form(x))


def _bench_lavo(ops, q, k, v, causal, x):
    return ops.lavo_attention(q, k, v, x["lavo_bases"], x["lavo_bias"], window=x["window"], causal=causal,
                              **_form(x))


METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("softmax", "softmax", "SoftmaxAttention", ("encoder", "decoder", "cross"),
           flops=lambda n, d, causal, cfg: (2 if causal else 4) * n * n * d,  # Q K^T and P V (causal: half)
           rows_note="exact: P V is the output",
           benchmark_op=lambda ops, q, k, v, causal, x: ops.softmax_attention(q, k, v, causal=causal),
           quadratic=True, dropout_keeps_matrix=True),  # with dropout, CPU SDPA takes its N x N math path
    Method("lln", "LLN", "LLNAttention", ("encoder", "decoder"), LLN_OPTIONS, flops=_lln_flops, check=_check_lln,
           rows_note="exact: P V is the output", colour="tab:blue", benchmark_op=_bench_lln),
    Method("lln_diag", "LLN+Diag", "LLNDiagAttention", ("encoder", "decoder"), LLN_OPTIONS + LLN_DIAG_OPTIONS,
           flops=lambda n, d, causal, cfg: _lln_flops(n, d, causal, cfg) + block_softmax_flops(
               n, d, cfg.lln_diag_block_size), check=_check_lln,
           rows_note="exact for mix 'average'; head-mean mix weights otherwise", colour="tab:purple",
           benchmark_op=_bench_lln_diag),
    Method("skyformer", "Skyformer", "SkyformerAttention", ("encoder",), SKYFORMER_OPTIONS, flops=_skyformer_flops,
           rows_note="Nyström kernel rows (eval landmarks), negatives clipped, normalised to sum 1",
           colour="tab:brown",
           rounding_gain=10.0,  # the Nyström (pseudo-)inverse amplifies half-precision rounding
           benchmark_op=_bench_skyformer),
    Method("kernelized", "Kernelized", "KernelizedAttention", ("encoder",),
           flops=lambda n, d, causal, cfg: 4 * n * n * d,  # the full Gaussian kernel and C V
           rows_note="kernel rows normalised to sum 1 (the kernel itself is not row-stochastic)", colour="tab:red",
           benchmark_op=lambda ops, q, k, v, causal, x: ops.kernelized_attention(q, k, v, **_form(x)),
           quadratic=True),
    Method("lavo", "LAVO", "LAVOAttention", ("encoder", "decoder", "cross"), LAVO_OPTIONS, flops=_lavo_flops,
           relative_positions=True,
           rows_note="token mixing 0.5 (local + memory mean); values also pass a per-query channel projection",
           colour="tab:olive", benchmark_op=_bench_lavo, benchmark_params=("lavo_bases", "lavo_bias")),
)}

# ops the benchmarks time beside the methods': block softmax is LLN+Diag's Diag part on its own
BENCHMARK_EXTRAS: Dict[str, BenchmarkOp] = {b.name: b for b in (
    BenchmarkOp("block_softmax", "block softmax",
                flops=lambda n, d, causal, cfg: block_softmax_flops(n, d, cfg.lln_diag_block_size),
                benchmark_op=lambda ops, q, k, v, causal, x: ops.block_softmax_attention(
                    q, k, v, block_size=x["block_size"], causal=causal, **_form(x))),
)}


def benchmarked() -> Dict[str, Any]:
    """Every op the benchmarks time, by name: the methods (``Method``), then ``BENCHMARK_EXTRAS``."""
    return {**METHODS, **BENCHMARK_EXTRAS}


def methods_for(role: str) -> List[str]:
    """Names of the methods usable in ``role`` (encoder, decoder or cross), in declaration order."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return [name for name, m in METHODS.items() if role in m.roles]


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linattn.methods", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="exit 2 with a message unless TYPES is a valid attention type "
                           "(or comma list) for ROLE")
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
        from linattn.config import options_table
        print(options_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

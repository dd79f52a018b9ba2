"""The attention methods, each declared once: its name, roles, the options it reads, FLOP count.

Everything that lists methods derives from ``METHODS``: the modules (each registers its class under the method's
name, fairseq_linattn/modules/registry.py), validation (``AttentionConfig.validate`` in linattn/config.py,
which declares the options), the tolerance table, and the tools (``linattn_tools.methods_extra``: titles,
plot colours and the benchmarks' calls; ``python -m linattn_tools.methods_cli``: the recipe scripts' check and
the README's options table). docs/design.md §9 says how to add a method. Pure Python: no torch, no fairseq.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

ROLES = ("encoder", "decoder", "cross")  # non-causal self-attention, causal self-attention, encoder-decoder
ROLE_OPTIONS = {"encoder": "encoder_attention_type", "decoder": "decoder_attention_type",
                "cross": "cross_attention_type"}


def flag(name: str) -> str:
    """lln_chunk_size -> --lln-chunk-size."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Method:
    """An attention method: where it can be used, what it reads, what it costs."""

    name: str
    roles: Tuple[str, ...]
    options: Tuple[str, ...] = ()  # AttentionConfig fields this method reads (the shared ones: every model)
    flops: Callable[..., float] = None  # (n, d, causal, cfg) -> matmul FLOPs of one forward per (batch, head)
    relative_positions: bool = False  # positions come from the attention itself (token positions dropped)
    # (cfg, layers) -> None, ValueError on a bad combination: the rules between its options (``cfg``: the
    # AttentionConfig; ``layers``: role -> the model's per-layer types, the roles known to the caller)
    check: Optional[Callable[[Any, Dict[str, List[str]]], None]] = None
    rounding_gain: float = 1.0  # how much more than an exact op the output may round in half precision

    @property
    def causal(self) -> bool:
        """Has a causal (decoder self-attention) form."""
        return "decoder" in self.roles


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


def _check_lln(cfg, layers: Dict[str, List[str]]) -> None:
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
    Method("softmax", ("encoder", "decoder", "cross"),
           flops=lambda n, d, causal, cfg: (2 if causal else 4) * n * n * d),  # Q K^T and P V (causal: half)
    Method("lln", ("encoder", "decoder"), LLN_OPTIONS, flops=_lln_flops, check=_check_lln),
    Method("lln_diag", ("encoder", "decoder"), LLN_OPTIONS + LLN_DIAG_OPTIONS,
           flops=lambda n, d, causal, cfg: _lln_flops(n, d, causal, cfg) + block_softmax_flops(
               n, d, cfg.lln_diag_block_size), check=_check_lln),
    Method("skyformer", ("encoder",), SKYFORMER_OPTIONS, flops=_skyformer_flops,
           rounding_gain=10.0),  # the Nyström (pseudo-)inverse amplifies half-precision rounding
    Method("kernelized", ("encoder",),
           flops=lambda n, d, causal, cfg: 4 * n * n * d),  # the full Gaussian kernel and C V
    Method("lavo", ("encoder", "decoder", "cross"), LAVO_OPTIONS, flops=_lavo_flops, relative_positions=True),
)}


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

"""What the tools know of each method beyond the registry (``linattn.methods.METHODS``), keyed by its name.

``METHODS_EXTRA``: its title in tables and plots, what its module's ``attention_rows`` are and its colour (the
analysis), how the benchmarks call its op, the shape of its cost (the benchmarks' tables and fits).
``BENCHMARK_EXTRAS``: ops timed beside the methods without being one (block softmax); ``benchmarked()``: both
as ``BenchmarkOp``. A new method needs its entry here (tests/plugin/test_options.py checks every method has one).
Pure Python: the benchmark calls get the ops module as an argument.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from linattn.methods import METHODS, block_softmax_flops


@dataclass(frozen=True)
class MethodExtra:
    """A method's presentation and benchmark call."""

    title: str  # for tables and plots
    rows_note: str  # what the module's ``attention_rows`` is, in a few words (the analysis reports it per layer)
    # (ops, q, k, v, causal, x) -> output: the benchmarks' call of its op (``ops``: linattn.ops or an earlier
    # copy of it); ``x``: alpha, beta, chunk_size, block_size, window, landmarks, lavo_bases, lavo_bias, impl
    benchmark_op: Callable[..., Any]
    colour: str = "black"  # the analysis plots' colour for this method's layers
    benchmark_params: Tuple[str, ...] = ()  # keys of ``x`` the benchmarks also take the gradient for
    quadratic: bool = False  # N x N time: an exact method (the op benchmark's FLOP-floor table lists the others)
    dropout_keeps_matrix: bool = False  # with attention dropout it stores the N x N probabilities


@dataclass(frozen=True)
class BenchmarkOp:
    """An op the benchmarks time: a method's or one beside them (fields as in ``Method`` and ``MethodExtra``)."""

    name: str
    title: str
    flops: Callable[..., float]
    benchmark_op: Callable[..., Any]
    causal: bool = True
    benchmark_params: Tuple[str, ...] = ()
    quadratic: bool = False


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


METHODS_EXTRA: Dict[str, MethodExtra] = {
    "softmax": MethodExtra(
        "softmax", "exact: P V is the output",
        lambda ops, q, k, v, causal, x: ops.softmax_attention(q, k, v, causal=causal),
        quadratic=True, dropout_keeps_matrix=True),  # with dropout, CPU SDPA takes its N x N math path
    "lln": MethodExtra("LLN", "exact: P V is the output", _bench_lln, colour="tab:blue"),
    "lln_diag": MethodExtra("LLN+Diag", "exact for mix 'average'; head-mean mix weights otherwise", _bench_lln_diag,
                            colour="tab:purple"),
    "skyformer": MethodExtra(
        "Skyformer", "Nyström kernel rows (eval landmarks), negatives clipped, normalised to sum 1", _bench_skyformer,
        colour="tab:brown"),
    "kernelized": MethodExtra(
        "Kernelized", "kernel rows normalised to sum 1 (the kernel itself is not row-stochastic)",
        lambda ops, q, k, v, causal, x: ops.kernelized_attention(q, k, v, **_form(x)), colour="tab:red",
        quadratic=True),
    "lavo": MethodExtra(
        "LAVO", "token mixing 0.5 (local + memory mean); values also pass a per-query channel projection",
        _bench_lavo, colour="tab:olive", benchmark_params=("lavo_bases", "lavo_bias")),
}

# ops the benchmarks time beside the methods': block softmax is LLN+Diag's Diag part on its own
BENCHMARK_EXTRAS: Dict[str, BenchmarkOp] = {b.name: b for b in (
    BenchmarkOp("block_softmax", "block softmax",
                flops=lambda n, d, causal, cfg: block_softmax_flops(n, d, cfg.lln_diag_block_size),
                benchmark_op=lambda ops, q, k, v, causal, x: ops.block_softmax_attention(
                    q, k, v, block_size=x["block_size"], causal=causal, **_form(x))),
)}


def benchmarked() -> Dict[str, BenchmarkOp]:
    """Every op the benchmarks time, by name: the methods (in ``METHODS``' order), then ``BENCHMARK_EXTRAS``."""
    ops = {}
    for name, m in METHODS.items():
        e = METHODS_EXTRA[name]
        ops[name] = BenchmarkOp(name, e.title, m.flops, e.benchmark_op, m.causal, e.benchmark_params, e.quadratic)
    return {**ops, **BENCHMARK_EXTRAS}

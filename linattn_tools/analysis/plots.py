"""PNG figures of the analysis command, in the style of the LLN paper's Fig. 1, 2, 5b and 7.

Each function takes the JSON-ready report of ``synthetic.synthetic_curves`` or of the checkpoint
analysis (``cli``) and writes one PNG (matplotlib's Agg backend, no display needed); returns its path.
"""
import logging
import math
import os
from typing import Dict, List

logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's root logger would print its font search
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"softmax": "softmax", "lln_unmatched": "LLN, α = β = 1 (unmatched)",
          "lln_paper": "LLN, matched (paper a, b)", "lln_exact": "LLN, matched (exact table)"}
COLOURS = {"softmax": "black", "lln_unmatched": "tab:orange", "lln_paper": "tab:blue", "lln_exact": "tab:green"}
DPI = 100


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def synthetic_variance_plot(report: Dict, out_dir: str) -> str:
    """var(ln P) against the input variance sigma² of Gaussian q, k (LLN Fig. 5b)."""
    x = [p["input_variance"] for p in report["points"]]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(x, [p["theory_log_p_var"] for p in report["points"]], ":", color="grey",
            label="softmax theory σ⁴ (Prop. 3.1)")
    for method, label in LABELS.items():
        ax.plot(x, [p[method]["log_p_var"] for p in report["points"]], "o-", ms=3, color=COLOURS[method],
                label=label)
    ax.set(xlabel="input variance σ² of q and k entries", ylabel="var(ln P)",
           title=f"Gaussian q, k: D = {report['head_dim']}, N = {report['seq_len']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, "synthetic_var_log_p.png")


def synthetic_histogram_plot(report: Dict, out_dir: str) -> str:
    """Histograms of ln P at one input variance, softmax against LLN, with Prop. 3.1's normal (LLN Fig. 2)."""
    v, n = report["histogram_variance"], report["seq_len"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method, values in report["log_p_samples"].items():
        ax.hist(values, bins=80, density=True, histtype="step", lw=1.4, color=COLOURS[method], label=LABELS[method])
    mean, var = -math.log(n) - v ** 2 / 2, v ** 2
    lo, hi = mean - 4 * math.sqrt(var), mean + 4 * math.sqrt(var)
    xs = [lo + (hi - lo) * i / 200 for i in range(201)]
    ax.plot(xs, [math.exp(-(x - mean) ** 2 / (2 * var)) / math.sqrt(2 * math.pi * var) for x in xs], "--",
            color="tab:red", lw=1.2, zorder=5, label="softmax theory N(−ln N − σ⁴/2, σ⁴)")
    ax.set(xlabel="ln P", ylabel="density", title=f"ln P at σ² = {v:g} (D = {report['head_dim']}, N = {n})")
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, out_dir, "synthetic_log_p_hist.png")


def synthetic_concentration_plot(report: Dict, out_dir: str) -> str:
    """Entropy and spectral gap against the input variance (softmax temperature 1/σ²; LLN Fig. 1)."""
    x = [p["input_variance"] for p in report["points"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, measure, ylabel in ((axes[0], "entropy", "entropy (bits)"), (axes[1], "spectral_gap", "spectral gap")):
        for method, label in LABELS.items():
            ax.plot(x, [p[method][measure] for p in report["points"]], "o-", ms=3, color=COLOURS[method], label=label)
        ax.set(xlabel="input variance σ² (softmax temperature 1/σ²)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].axhline(math.log2(report["seq_len"]), ls=":", color="grey", label="log₂ N (uniform)")
    axes[0].legend(fontsize=7)
    return _save(fig, out_dir, "synthetic_concentration.png")


def _layer_axis(ax, layers: List[Dict]):
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([f"{layer['label']}\n{layer['type']}" for layer in layers], fontsize=8)


def layers_plot(report: Dict, out_dir: str) -> str:
    """Entropy and spectral gap of every head, per layer (LLN Fig. 1 and 7)."""
    layers = report["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(max(7, 1.2 * len(layers) + 4), 3.8))
    for ax, measure, ylabel in ((axes[0], "entropy", "entropy (bits)"), (axes[1], "spectral_gap", "spectral gap")):
        for i, layer in enumerate(layers):
            values = [head[measure] for head in layer["heads"]]
            ax.scatter([i] * len(values), values, s=14, color=layer.get("colour", "black"), alpha=0.7)
        ax.plot(range(len(layers)), [layer["mean"][measure] for layer in layers], "-", color="grey", lw=1)
        _layer_axis(ax, layers)
        ax.set(ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].plot(range(len(layers)), [layer["mean"]["entropy_max"] for layer in layers], ":", color="grey",
                 label="uniform rows")
    axes[0].legend(fontsize=8)
    fig.suptitle("heads (dots) and layer mean (line)", fontsize=9)
    return _save(fig, out_dir, "entropy_gap_per_layer.png")


def layer_histograms_plot(report: Dict, out_dir: str) -> str:
    """Histograms of ln(n_i P_ij) per layer (ln P relative to a uniform row; LLN Fig. 7)."""
    layers = [layer for layer in report["layers"] if layer.get("log_p_rel")]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    styles = ["-", "--", "-.", ":"]
    for i, layer in enumerate(layers):
        ax.hist(layer["log_p_rel"], bins=60, density=True, histtype="step", lw=1.3, ls=styles[i % len(styles)],
                color=layer.get("colour", "black"), label=f"{layer['label']} ({layer['type']})")
    ax.set(xlabel="ln(n·P): ln P relative to a uniform row over the n visible keys", ylabel="density")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "log_p_histograms.png")


def layer_variance_plot(report: Dict, out_dir: str) -> str:
    """Per head: var ln(n P) of softmax, unmatched and matched LLN on the head's own q, k, against its
    input variance sigma_q² sigma_k² (LLN Fig. 5b on the model's inputs)."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    heads = [head for layer in report["layers"] for head in layer["heads"]]
    x = [head["sigma_q"] ** 2 * head["sigma_k"] ** 2 for head in heads]
    for method in ("softmax", "lln_unmatched", "lln_paper"):
        ax.scatter(x, [head[f"log_p_rel_var_{method}"] for head in heads], s=16, color=COLOURS[method],
                   label=LABELS[method])
    top = max(x) if x else 1.0
    ax.plot([0, top], [0, top], ":", color="grey", label="y = x (softmax, Gaussian inputs)")
    ax.set(xlabel="input variance σ_q² σ_k² of the head", ylabel="var ln(n·P)",
           title="each head's q, k under three attentions")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, "var_log_p_vs_input_variance.png")

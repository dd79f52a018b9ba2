"""``python -m linattn_tools.analysis``: concentration of every layer and head of a checkpoint.

    python -m linattn_tools.analysis CHECKPOINT --data DATA_DIR --out OUT_DIR
    python -m linattn_tools.analysis --synthetic --out OUT_DIR

Checkpoint mode loads a fairseq checkpoint of one of the plugin's models, runs it in eval mode on a
few batches of the data's ``--split`` (forward hooks capture each self-attention module's input) and
writes ``analysis.json`` (per layer and head: entropy, spectral gap, sparsity, ln P moments,
temperatures, LLN alpha/beta; see ``layer_stats.sequence_statistics``, averaged over the sequences)
with ``entropy_gap_per_layer.png``, ``log_p_histograms.png`` and ``var_log_p_vs_input_variance.png``.
``--synthetic`` draws Gaussian q, k instead (``synthetic.py``) and writes ``synthetic.json`` with
``synthetic_var_log_p.png``, ``synthetic_log_p_hist.png`` and ``synthetic_concentration.png``.
Errors (missing files, a model without the plugin's attention) print one line and exit with 2.
"""
import argparse
import itertools
import json
import math
import os
import sys
from collections import defaultdict
from typing import Dict, List

import torch

from linattn.analysis.synthetic import DEFAULT_VARIANCES, synthetic_curves
from linattn_tools.methods_extra import METHODS_EXTRA

from . import plots


class AnalysisError(Exception):
    """A problem with the command's input, reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.analysis", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="fairseq checkpoint of a fairseq_linattn model")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--data", help="data directory of the checkpoint's task (binarised, with dict.txt)")
    parser.add_argument("--split", default="valid", help="data split to run the model on")
    parser.add_argument("--batches", type=int, default=2, help="number of batches")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    parser.add_argument("--max-rows", type=int, default=512,
                        help="query rows per sequence for entropy, sparsity, ln P (evenly spaced beyond this)")
    parser.add_argument("--max-chain", type=int, default=512,
                        help="tokens of the square chain for the spectral gap (a sequence's first tokens)")
    parser.add_argument("--device", default="cpu", help="torch device for the model")
    parser.add_argument("--seed", type=int, default=0)
    synthetic = parser.add_argument_group("synthetic mode (Gaussian q, k; no checkpoint)")
    synthetic.add_argument("--synthetic", action="store_true", help="measure Gaussian q, k instead of a checkpoint")
    synthetic.add_argument("--head-dim", type=int, default=64, help="head dim D")
    synthetic.add_argument("--seq-len", type=int, default=256, help="sequence length N")
    synthetic.add_argument("--num-matrices", type=int, default=4, help="N x N matrices per point")
    synthetic.add_argument("--variances", type=float, nargs="+", default=list(DEFAULT_VARIANCES),
                           help="input variances sigma² of the q, k entries")
    return parser


def _json_ready(value):
    """NaN -> null, tensors -> lists: strict JSON."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _write_json(report: Dict, path: str, drop: str) -> None:
    """The report without its plotting samples (key ``drop`` at the top and in each layer)."""
    slim = {k: v for k, v in report.items() if k != drop}
    if "layers" in slim:
        slim["layers"] = [{k: v for k, v in layer.items() if k != drop} for layer in slim["layers"]]
    with open(path, "w") as f:
        json.dump(_json_ready(slim), f, indent=1, allow_nan=False)


def run_synthetic(args) -> List[str]:
    report = synthetic_curves(head_dim=args.head_dim, seq_len=args.seq_len, variances=args.variances,
                              num_matrices=args.num_matrices, seed=args.seed)
    _write_json(report, os.path.join(args.out, "synthetic.json"), drop="log_p_samples")
    return [os.path.join(args.out, "synthetic.json"), plots.synthetic_variance_plot(report, args.out),
            plots.synthetic_histogram_plot(report, args.out), plots.synthetic_concentration_plot(report, args.out)]


def load_checkpoint(path: str, data: str):
    """(model in eval mode, task) of a fairseq checkpoint; AnalysisError for missing or foreign input."""
    if not os.path.isfile(path):
        raise AnalysisError(f"checkpoint not found: {path}")
    if not data:
        raise AnalysisError("--data DIR is required with a checkpoint (the data directory of its task)")
    if not os.path.isdir(data):
        raise AnalysisError(f"--data: directory not found: {data}")
    from fairseq import checkpoint_utils

    import fairseq_linattn  # noqa: F401  (registers the models before the checkpoint is read)
    from fairseq_linattn.analysis.training_stats import self_attention_modules

    # the measures run the model in float32 on --device: auto, whatever implementation it trained with
    overrides = {"data": data, "attention_impl": "auto"}
    try:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    except Exception as e:  # fairseq raises many kinds; the message is what the user needs
        raise AnalysisError(f"could not load checkpoint {path}: {type(e).__name__}: {e}") from e
    model = models[0].eval()
    if not self_attention_modules(model):
        found = sorted({type(m).__name__ for name, m in model.named_modules() if name.endswith("attn")})
        raise AnalysisError(
            f"{path} has no fairseq_linattn attention (its attention modules: {', '.join(found) or 'none'}); "
            "the analysis measures models of the plugin: --arch linattn_lm_*, linattn_roberta_*, "
            "linattn_transformer_* trained with --user-dir fairseq_linattn")
    return model, task


class _Capture:
    """Forward hooks measuring each self-attention module's input, sequence by sequence."""

    def __init__(self, model, args):
        from fairseq_linattn.analysis.training_stats import layer_label, self_attention_modules

        self.args = args
        self.generator = torch.Generator().manual_seed(args.seed)
        self.per_sequence = defaultdict(list)
        self.samples = defaultdict(list)
        self.layers = []
        for i, (name, module) in enumerate(self_attention_modules(model)):
            self.layers.append((name, layer_label(name, i), module))
            module.register_forward_hook(self._hook(name), with_kwargs=True)

    def _hook(self, name):
        from fairseq_linattn.analysis.layer_stats import lln_forward_parameters, sequence_statistics
        from fairseq_linattn.analysis.module_matrix import projected_qk
        from fairseq_linattn.analysis.training_stats import call_arguments

        def record(module, args, kwargs, output):
            query, mask, _ = call_arguments(args, kwargs)
            q, k = projected_qk(module, query)
            for b in range(q.shape[0]):
                stats = sequence_statistics(module, q, k, mask, b, max_rows=self.args.max_rows,
                                            max_chain=self.args.max_chain, lln=lln_forward_parameters(module),
                                            log_p_samples=2000, generator=self.generator, compare=True)
                self.samples[name].append(stats.pop("log_p_rel"))
                self.per_sequence[name].append(stats)
        return record

    def report(self) -> List[Dict]:
        layers = []
        for name, label, module in self.layers:
            rows = self.per_sequence[name]
            measures = {key: torch.stack([r[key] for r in rows]).nanmean(0) for key in rows[0]}  # (H,) each
            heads = [{key: value[h].item() for key, value in measures.items()} for h in range(module.num_heads)]
            extra = METHODS_EXTRA[module.method]
            layers.append({
                "name": name, "label": label, "type": module.method, "causal": module.causal,
                "num_heads": module.num_heads, "head_dim": module.head_dim, "sequences": len(rows),
                "matrix": extra.rows_note, "colour": extra.colour, "heads": heads,
                "mean": {key: value.nanmean().item() for key, value in measures.items()},
                "log_p_rel": torch.cat(self.samples[name])[:20000].tolist(),
            })
        return layers


def analyse_checkpoint(args) -> List[str]:
    from fairseq import utils

    model, task = load_checkpoint(args.checkpoint, args.data)
    model.to(args.device)
    try:
        task.load_dataset(args.split)
    except Exception as e:
        raise AnalysisError(f"--split {args.split}: could not load it from {args.data}: {e}") from e
    dataset = task.dataset(args.split)
    batches = task.get_batch_iterator(
        dataset=dataset, max_sentences=args.batch_size, ignore_invalid_inputs=True, seed=args.seed,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
    ).next_epoch_itr(shuffle=False)
    capture = _Capture(model, args)
    done = 0
    with torch.no_grad():
        for sample in itertools.islice(batches, args.batches):
            model(**utils.apply_to_sample(lambda t: t.to(args.device), sample)["net_input"])
            done += 1
    if not done:
        raise AnalysisError(f"--split {args.split} of {args.data} gave no batch")
    report = {"mode": "checkpoint", "checkpoint": os.path.abspath(args.checkpoint), "data": os.path.abspath(args.data),
              "split": args.split, "batches": done, "max_rows": args.max_rows,
              "max_chain": args.max_chain, "layers": capture.report()}
    path = os.path.join(args.out, "analysis.json")
    _write_json(report, path, drop="log_p_rel")
    return [path, plots.layers_plot(report, args.out), plots.layer_histograms_plot(report, args.out),
            plots.layer_variance_plot(report, args.out)]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batches", "batch_size", "max_rows", "max_chain"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.synthetic == (args.checkpoint is not None):
        parser.error("give either a CHECKPOINT or --synthetic")
    os.makedirs(args.out, exist_ok=True)
    try:
        written = run_synthetic(args) if args.synthetic else analyse_checkpoint(args)
    except (AnalysisError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0

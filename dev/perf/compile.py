"""The CPU time of a model update with ``--attention-compile`` against eager, both in the parallel implementation.

One fairseq update of ``linattn_roberta_base`` (masked-LM forward, backward, Adam; B = 1, N tokens) per encoder
attention, eager and with each attention module's op call under ``torch.compile(dynamic=True)``. Reported: the
first update (a compiled model's includes Dynamo's tracing and Inductor's build: C++ with gcc here, Triton on a
GPU; Dynamo's caches are reset before each compiled model, as in a fresh process), the median of the next
``--repeats`` updates (eager and compiled updates alternated, so the machine's drift enters both) and the graphs
Dynamo made (more than one per attention class would be graph breaks).

    python -m dev.perf.compile --docs docs/benchmarks.md
    python -m dev.perf.compile --quick --json /tmp/compile.json
"""
import argparse
import json
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch._dynamo
from torch._dynamo.utils import counters

ROOT = Path(__file__).resolve().parents[2]

from linattn.methods import methods_for
from linattn_tools.benchmark import fairseq_models, measure, report
from linattn_tools.benchmark.cli import write_json
from linattn_tools.benchmark.model import train_case
from linattn_tools.methods_extra import METHODS_EXTRA

DEFAULT_JSON = ROOT / "docs" / "benchmarks" / "compile.json"
MODES = {"eager": [], "compiled": ["--attention-compile"]}
QUICK = dict(sizes=[32], arch="linattn_roberta_tiny", vocab=100, repeats=1, methods=["lln"],
             model_args=["--lln-chunk-size", "8"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=methods_for("encoder"),
                   default=["lln", "lln_diag", "lavo", "skyformer"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--arch", default="linattn_roberta_base")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per mode after the first")
    p.add_argument("--vocab", type=int, default=None, help="dictionary size (default: RoBERTa's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None, help=f"write the results here (default {DEFAULT_JSON})")
    p.add_argument("--docs", type=Path, default=None, help="rewrite the --section section of this markdown")
    p.add_argument("--section", default="attention-compile")
    p.add_argument("--from-json", type=Path, default=None, help="render these results instead of measuring")
    p.add_argument("--quick", action="store_true", help="a tiny model at N = 32, LLN only, nothing written")
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="extra fairseq/plugin options for every model (last on the command line)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    elif args.json is None and args.from_json is None:
        args.json = DEFAULT_JSON
    return args


def _update(method: str, n: int, mode: str, data: Path, args, device):
    """One update of a freshly built model: call() -> loss (``model.train_case`` with the mode's options)."""
    options = SimpleNamespace(train_arch=args.arch, attention_dropout=0.0, batch=1,
                              model_args=["--attention-impl", "parallel", *MODES[mode], *args.model_args])
    return train_case(method, data, options, device)(n, None)


def measure_point(method: str, n: int, data: Path, args, device) -> dict:
    """First-update and steady update times of both modes at one N, and the graphs Dynamo made."""
    row = {"method": method, "n": n}
    calls = {}
    for mode in MODES:
        torch._dynamo.reset()
        counters.clear()
        calls[mode] = _update(method, n, mode, data, args, device)
        row[f"{mode}_first_s"] = measure.elapsed_seconds(calls[mode], device)
        if mode == "compiled":
            row["graphs"] = counters["stats"]["unique_graphs"]
    samples = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for mode in (list(MODES) if i % 2 == 0 else list(MODES)[::-1]):
            samples[mode].append(measure.elapsed_seconds(calls[mode], device))
    for mode, times in samples.items():
        row[f"{mode}_s"] = times
    print(f"{method} N={n}: eager {statistics.median(samples['eager']):.3f} s, compiled "
          f"{statistics.median(samples['compiled']):.3f} s (first {row['compiled_first_s']:.1f} s, "
          f"{row['graphs']} graphs)", flush=True)
    return row


def measure_all(args) -> dict:
    device = torch.device(args.device)
    out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "machine": measure.machine_info(device), "load_start": measure.load_average(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = fairseq_models.write_dictionary(Path(tmp) / "roberta", (args.vocab or fairseq_models.ROBERTA_VOCAB) - 5)
        for method in args.methods:
            for n in args.sizes:
                out["rows"].append(measure_point(method, n, data, args, device))
    out["load_end"] = measure.load_average()
    return out


def render(res: dict) -> str:
    """The machine, the settings and one row per method and N: steady seconds per update of both modes, their
    ratio, the first compiled update and Dynamo's graphs."""
    c = res["config"]
    lines = ["| method | N | eager s / update | compiled s / update | compiled / eager | first update eager, "
             "compiled (s) | graphs |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        eager, compiled = statistics.median(r["eager_s"]), statistics.median(r["compiled_s"])
        lines.append(f"| {METHODS_EXTRA[r['method']].title} | {r['n']} | {eager:.2f} | {compiled:.2f} | "
                     f"{compiled / eager:.2f} | {r['eager_first_s']:.1f}, {r['compiled_first_s']:.1f} | "
                     f"{r['graphs']} |")
    return "\n\n".join([
        report.machine_lines(res["machine"], res["load_start"])
        + f" Load at the end: {', '.join(f'{x:.2f}' for x in res['load_end'])}.",
        f"{c['arch']} update (masked-LM forward, backward, Adam), B = 1, `--attention-impl parallel`, eager and "
        f"`--attention-compile`; median of {c['repeats']} updates after the first, the modes alternated.",
        "\n".join(lines)])


def main(argv=None):
    args = parse_args(argv)
    res = json.loads(args.from_json.read_text()) if args.from_json else measure_all(args)
    if args.json and not args.from_json:
        write_json(args.json, res)
    text = render(res)
    print(text)
    if args.docs:
        report.write_section(args.docs, args.section, text)


if __name__ == "__main__":
    main()

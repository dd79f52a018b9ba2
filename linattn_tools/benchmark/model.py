"""Whole-model benchmarks: a linattn_roberta_base training step, and linattn_lm_gpt decoding latency.

- ``train``: one fairseq update (masked-LM forward on 15% masked tokens, backward, Adam step) of
  ``linattn_roberta_base`` (12 layers, 768-d, 12 heads, vocabulary 50265) at B=1 and N tokens, per
  encoder attention: time per update (median after warm-up) and the peak memory of an update above
  the parameters and optimizer state (LLN Table 2's layout). Attention dropout is 0 by default
  (``--attention-dropout``): with dropout, CPU SDPA falls back to its N×N math path.
- ``decode``: per-token latency of ``linattn_lm_gpt`` (12 layers, 768-d, vocabulary 50257) decoding
  one token with fairseq's incremental state after a context of L tokens, for softmax, LLN and LAVO.
  The state for context L is filled with random keys/values of the right size (softmax keeps L keys
  and values per layer; LLN and LAVO a fixed-size state, with their position counters set to L):
  the step's cost depends on the sizes, not on the values, and running L real steps first would take
  hours for softmax on a CPU.
- ``cross``: per-token latency of an encoder-decoder (``linattn_transformer``, LLN encoder, LAVO decoder)
  decoding after a source of S tokens, with LAVO cross-attention (its source memory kept in the
  incremental state: the cost per token should not depend on S) beside fairseq's softmax
  cross-attention (keys and values of the S source tokens kept, attended every step). The encoder runs
  once per source, outside the timing, and so does the first decoding step, which reads the source.
  The models for all S are built first and their steps alternate, so the ratio between two S is not
  the machine's drift between them.
  ``--parts cross`` re-measures only this part and keeps the others of ``--json``.

Defaults finish in about 60 minutes on 2 CPU cores: train at N = 512 ... 16384 for softmax, lln,
lln_diag, skyformer, lavo (up to 3 timed updates, 1 where an update takes over 45 s; a method stops where
its last two points predict more than 16 GiB); decode at L = 1K ... 16K (20 tokens each); cross at S = 1K,
4K, 16K. They run with glibc's default allocator, as a user's ``fairseq-train`` on a CPU does
(``--malloc keep``: freed memory kept, as a GPU's caching allocator does).

    python -m linattn_tools.benchmark.model --docs docs/benchmarks.md
    python -m linattn_tools.benchmark.model --quick --json /tmp/model.json
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from linattn.methods import methods_for
from linattn_tools.benchmark import cli, fairseq_models, fit, measure, report, sweep
from linattn_tools.methods_extra import METHODS_EXTRA

DEFAULT_JSON = ROOT / "docs" / "benchmarks" / "model.json"
DEFAULT_PLOT = ROOT / "docs" / "img" / "benchmark_model.png"
ENCODER_METHODS, DECODER_METHODS, CROSS_METHODS = (methods_for(role) for role in ("encoder", "decoder", "cross"))
PARTS = ("train", "decode", "cross")
CONSTANT_STATE_TARGETS = ("lln", "lavo")  # decoders with a per-token latency target (state of fixed size)
QUICK = dict(train_sizes=[32], decode_contexts=[16, 32], train_arch="linattn_roberta_tiny",
             decode_arch="linattn_lm_tiny", cross_sources=[16, 64],
             cross_arch="linattn_transformer_tiny", vocab=100, train_repeats=1, decode_repeats=2, min_repeats=1,
             point_seconds=1.0, model_args=["--lln-chunk-size", "8", "--lln-diag-block-size", "8", "--lavo-window", "8",
                                            "--skyformer-landmarks", "8"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to measure; with some parts only, the others are kept from --json")
    p.add_argument("--train-sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--train-methods", nargs="+", choices=ENCODER_METHODS,
                   default=["softmax", "lln", "lln_diag", "skyformer", "lavo"])
    p.add_argument("--train-arch", default="linattn_roberta_base")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--decode-methods", nargs="+", choices=DECODER_METHODS, default=["softmax", "lln", "lavo"])
    p.add_argument("--decode-arch", default="linattn_lm_gpt")
    p.add_argument("--cross-sources", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="source lengths S of the cross-attention decoding part")
    p.add_argument("--cross-methods", nargs="+", choices=CROSS_METHODS, default=list(CROSS_METHODS))
    p.add_argument("--cross-arch", default="linattn_transformer")
    p.add_argument("--vocab", type=int, default=None, help="dictionary size (default: RoBERTa's / GPT-2's)")
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="extra fairseq/plugin options for every model (last on the command line)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--decode-repeats", type=int, default=20, help="decoded tokens timed per context")
    p.add_argument("--min-repeats", type=int, default=1)
    p.add_argument("--point-seconds", type=float, default=90.0)
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds per update / token")
    p.add_argument("--memory-budget-gib", type=float, default=16.0)
    p.add_argument("--fit-budget-gib", type=float, default=20.0,
                   help="report the longest N whose update (parameters, Adam state, peak) fits in this much")
    p.add_argument("--no-memory", action="store_true")
    cli.add_output_arguments(p, "model", DEFAULT_JSON, DEFAULT_PLOT, malloc_default="default")
    return cli.finish_args(p.parse_args(argv), QUICK, DEFAULT_JSON, DEFAULT_PLOT)


def _device_args(device: torch.device):
    return ["--cpu"] if device.type == "cpu" else []


def train_case(method: str, data: Path, args, device):
    def build(n, _):
        built = fairseq_models.build(data, [
            "--task", "masked_lm", "--criterion", "masked_lm", "--arch", args.train_arch,
            "--encoder-attention-type", method, "--tokens-per-sample", str(n), "--max-positions", str(n),
            "--attention-dropout", str(args.attention_dropout), "--optimizer", "adam", "--lr", "1e-4",
            "--seed", "1", *_device_args(device), *args.model_args])
        model, criterion, optimizer = built["model"].to(device), built["criterion"], built["optimizer"]
        sample = fairseq_models.masked_lm_sample(built["task"], n, args.batch,
                                                 generator=torch.Generator().manual_seed(n))
        sample = _to(sample, device)

        def call():
            return fairseq_models.training_step(model, criterion, optimizer, sample)
        call.extra = lambda: {"state_bytes": fairseq_models.state_bytes(model, optimizer)}
        return call
    return build


def _to(sample, device):
    if isinstance(sample, dict):
        return {k: _to(v, device) for k, v in sample.items()}
    return sample.to(device) if isinstance(sample, torch.Tensor) else sample


def fill_state(attn, state: dict, context: int) -> None:
    """Make a decoder layer's incremental state look as after ``context`` tokens (see the module doc)."""
    buf = attn._get_input_buffer(state)
    if "prev_key" in buf and "mem_count" not in buf:  # a key/value cache that grows with the context
        # (softmax): ``context`` random keys and values; LAVO's prev_key is its fixed window, handled below
        b, h, _, d = buf["prev_key"].shape
        kv = dict(dtype=buf["prev_key"].dtype, device=buf["prev_key"].device)
        buf["prev_key"], buf["prev_value"] = torch.randn(b, h, context, d, **kv), torch.randn(b, h, context, d, **kv)
        buf["prev_key_padding_mask"] = torch.zeros(b, context, dtype=torch.bool, device=kv["device"])
    if "position" in buf:
        buf["position"] = torch.full_like(buf["position"], context)
    if "mem_count" in buf:  # LAVO: tokens of the completed windows, a window of real tokens
        buf["mem_count"] = torch.full_like(buf["mem_count"], context - context % attn.window)
        buf["window_count"] = torch.full_like(buf["window_count"], context % attn.window)
        buf["prev_key_padding_mask"] = torch.zeros_like(buf["prev_key_padding_mask"])
    attn._set_input_buffer(state, buf)


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for buf in state.values() for t in buf.values()
               if isinstance(t, torch.Tensor))


def decode_case(method: str, data: Path, args, device, max_tokens: int):
    def build(context, _):
        built = fairseq_models.build(data, [
            "--task", "language_modeling", "--arch", args.decode_arch, "--decoder-attention-type", method,
            "--tokens-per-sample", str(max_tokens), "--max-target-positions", str(max_tokens), "--seed", "1",
            *_device_args(device), *args.model_args], optimizer=False)
        model = built["model"].to(device).eval()
        d = built["task"].target_dictionary
        tokens = torch.randint(d.nspecial, len(d), (args.batch, context + 1 + 8 + args.decode_repeats * 2),
                               generator=torch.Generator().manual_seed(context)).to(device)
        state, pos = {}, [0]

        def call():
            with torch.no_grad():
                model.decoder(tokens[:, :pos[0] + 1], incremental_state=state)
            pos[0] += 1

        for _ in range(2):  # real steps create every layer's buffers
            call()
        for layer in model.decoder.layers:
            fill_state(layer.self_attn, state, context)
        pos[0] = context
        call.extra = lambda: {"state_bytes": state_bytes(state)}
        return call
    return build


def cross_case(method: str, data: Path, args, device):
    def build(source, _):
        built = fairseq_models.build(data, [
            "--task", "translation", "--source-lang", "src", "--target-lang", "tgt", "--arch", args.cross_arch,
            "--encoder-attention-type", "lln", "--decoder-attention-type", "lavo", "--cross-attention-type", method,
            "--max-source-positions", str(source + 8), "--max-target-positions", str(64 + 2 * args.decode_repeats),
            "--seed", "1", *_device_args(device), *args.model_args], optimizer=False)
        model = built["model"].to(device).eval()
        d = built["task"].source_dictionary
        g = torch.Generator().manual_seed(source)
        src = torch.randint(d.nspecial, len(d), (args.batch, source), generator=g).to(device)
        tgt = torch.randint(d.nspecial, len(d), (args.batch, 8 + 2 * args.decode_repeats), generator=g).to(device)
        with torch.no_grad():
            enc = model.encoder(src, src_lengths=torch.full((args.batch,), source, device=device))
        state, pos = {}, [0]

        def call():
            with torch.no_grad():
                model.decoder(tgt[:, :pos[0] + 1], encoder_out=enc, incremental_state=state)
            pos[0] += 1

        call()  # the first step reads the source (LAVO: its memory; softmax: its keys and values)
        call.extra = lambda: {"state_bytes": state_bytes(state)}
        return call
    return build


def interleaved(case, sizes, device, repeats: int, name: str) -> list:
    """Rows as ``sweep.run`` makes them, with the sizes' calls alternated (one of each in turn, the order
    flipped every round) so that a ratio between sizes is not a drift of the machine between them."""
    calls = {n: case(n, None) for n in sizes}
    samples = {n: [] for n in sizes}
    for i in range(repeats):
        for n in (sizes if i % 2 == 0 else sizes[::-1]):
            samples[n].append(measure.elapsed_seconds(calls[n], device))
    rows = []
    for n in sizes:
        row = {"n": n, "note": None, "peak_bytes": None, **calls[n].extra()}
        sweep._finish(row, samples[n], print, name)
        rows.append(row)
    return rows


def run_part(cases, sizes, args, device, repeats):
    """One model alive at a time: each case builds its model at each size, measures it, frees it."""
    res = sweep.run(cases, sizes, device, time_budget=args.time_budget,
                    memory_budget=args.memory_budget_gib * 2 ** 30, warmup=args.warmup, repeats=repeats,
                    min_repeats=args.min_repeats, point_seconds=args.point_seconds,
                    measure_memory=not args.no_memory, interleave=False)
    return {"points": res["points"], "matmul_flops": {str(n): r for n, r in res["matmul_flops"].items()}}


def measure_all(args) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "machine": measure.machine_info(device), "load_start": measure.load_average()}
    with tempfile.TemporaryDirectory() as tmp:
        if "train" in args.parts:
            data = fairseq_models.write_dictionary(Path(tmp) / "roberta",
                                                   (args.vocab or fairseq_models.ROBERTA_VOCAB) - 5)
            out["train"] = run_part({m: train_case(m, data, args, device) for m in args.train_methods},
                                    args.train_sizes, args, device, args.train_repeats)
        if "decode" in args.parts:
            data = fairseq_models.write_dictionary(Path(tmp) / "lm", (args.vocab or fairseq_models.GPT2_VOCAB) - 4)
            max_tokens = max(args.decode_contexts) + 16 + 2 * args.decode_repeats
            out["decode"] = run_part({m: decode_case(m, data, args, device, max_tokens) for m in args.decode_methods},
                                     args.decode_contexts, args, device, args.decode_repeats)
        if "cross" in args.parts:
            data = fairseq_models.write_dictionary(Path(tmp) / "mt", (args.vocab or 32000) - 4)
            for lang in ("src", "tgt"):
                (data / f"dict.{lang}.txt").write_text((data / "dict.txt").read_text())
            start = measure.load_average()
            out["cross"] = {"points": {m: interleaved(cross_case(m, data, args, device), args.cross_sources, device,
                                                      args.decode_repeats, m) for m in args.cross_methods}}
            out["cross"].update(machine=out["machine"], load_start=start, load_end=measure.load_average(),
                                config={k: getattr(args, k) for k in ("cross_sources", "cross_arch", "batch",
                                                                      "decode_repeats")})
    out["load_end"] = measure.load_average()
    keep = [part for part in PARTS if part not in args.parts]
    if keep and args.json and args.json.exists():  # --parts cross: the other parts stay as measured before
        old = json.loads(args.json.read_text())
        out = {**old, **{part: out[part] for part in args.parts}}
    return out


def _row(part: dict, method: str, n: int):
    for r in part["points"].get(method, []):
        if r["n"] == n and r["status"] == "ok":
            return r
    return None


def targets(res: dict) -> list:
    out = []

    def add(text, value, ok, fmt):
        out.append({"target": text, "measured": "n/a" if value is None else fmt.format(value),
                    "met": value is not None and ok(value)})

    if "train" in res:
        t = res["train"]
        a, b = _row(t, "softmax", 4096), _row(t, "lln_diag", 4096)
        add("RoBERTa-base update at N=4096: LLN+Diag ≥ 2× faster than softmax",
            None if not (a and b) else a["median_s"] / b["median_s"], lambda x: x >= 2, "{:.2f}×")
        a, b = _row(t, "softmax", 512), _row(t, "lln_diag", 512)
        add("RoBERTa-base update at N=512: LLN+Diag ≤ 1.3× the softmax time",
            None if not (a and b) else b["median_s"] / a["median_s"], lambda x: x <= 1.3, "{:.2f}×")
    if "decode" in res:
        d = res["decode"]
        lo, hi = min(res["config"]["decode_contexts"]), max(res["config"]["decode_contexts"])
        for m in CONSTANT_STATE_TARGETS:
            a, b = _row(d, m, lo), _row(d, m, hi)
            add(f"{m} decoding: per-token latency at context {hi} ≤ 1.2× that at {lo}",
                None if not (a and b) else b["median_s"] / a["median_s"], lambda x: x <= 1.2, "{:.2f}×")
    if "cross" in res:
        x = res["cross"]
        lo, hi = min(x["config"]["cross_sources"]), max(x["config"]["cross_sources"])
        a, b = _row(x, "lavo", lo), _row(x, "lavo", hi)
        add(f"LAVO cross-attention decoding: per-token latency at source {hi} ≤ 1.2× that at {lo}",
            None if not (a and b) else b["median_s"] / a["median_s"], lambda x: x <= 1.2, "{:.2f}×")
    return out


def memory_rows(points: dict) -> dict:
    """The rows as the memory tables read them: a point over a budget still had its peak measured (the warm-up
    and the memory run come before the budget check), so it counts, marked with the budget it exceeded."""
    return {m: [dict(r, status="ok", over=r["note"]) if r["status"] == "over budget" and r.get("peak_bytes")
                else r for r in rows] for m, rows in points.items()}


def longest_update_table(res: dict) -> str:
    """Per method, the longest N whose whole update (parameters, Adam state and the update's peak) fits in
    ``--fit-budget-gib``, from a fit of the measured points (``fit.longest_n``)."""
    c = res["config"]
    budget = c.get("fit_budget_gib", 20.0) * 2 ** 30
    lines = [f"**Longest N whose update fits in {budget / 2 ** 30:g} GiB** (parameters + Adam state + the update's "
             "peak, tensor bytes; fitted linearly through the two longest measured N, quadratically through all "
             "of them for softmax with attention dropout, which keeps N × N probabilities)", "",
             "| method | update at the longest measured N | longest N (fit) | power of two |", "|---|---|---|---|"]
    for method, rows in memory_rows(res["train"]["points"]).items():
        ok = [r for r in rows if r["status"] == "ok" and r.get("peak_bytes") is not None]
        if len(ok) < 2:
            lines.append(f"| {method} | n/a | n/a (fewer than 2 measured N) | |")
            continue
        totals = [r["peak_bytes"] + r["state_bytes"] for r in ok]
        f = fit.longest_n([r["n"] for r in ok], totals, budget,
                          quadratic=METHODS_EXTRA[method].dropout_keeps_matrix and c["attention_dropout"] > 0)
        longest = f"{f['n_max']:,.0f}" if f["grid_max"] else "n/a (memory does not grow with N)"
        lines.append(f"| {method} | {totals[-1] / 2 ** 30:.2f} GiB at {ok[-1]['n']} | {longest} "
                     f"| {f['grid_max'] or ''} |")
    return "\n".join(lines)


def render(res: dict, image: str) -> str:
    c = res["config"]
    parts = [report.machine_lines(res["machine"], res["load_start"]) +
             f" Load at the end: {', '.join(f'{x:.2f}' for x in res['load_end'])}.",
             f"![model benchmark]({image})" if image else "", "**Targets**\n\n" + report.targets_table(targets(res))]
    if "train" in res:
        pts = res["train"]["points"]
        sizes = c["train_sizes"]
        parts.append(f"**{c['train_arch']} training update (masked-LM forward, backward, Adam), B={c['batch']}, "
                     f"attention dropout {c['attention_dropout']:g}: seconds per update** (median of "
                     f"{c['min_repeats']}–{c['train_repeats']} after {c['warmup']} warm-up)\n\n" +
                     report.table(pts, sizes, lambda r: f"{r['median_s']:.2f}"))
        parts.append("**Peak memory of an update above parameters + Adam state (MiB)**\n\n" +
                     report.table(memory_rows(pts), sizes, lambda r: None if r.get("peak_bytes") is None
                                  else f"{r['peak_bytes'] / report.MiB:.0f}"
                                  + (f" (update {r['over']})" if r.get("over") else "")))
        parts.append(longest_update_table(res))
    if "decode" in res:
        pts = res["decode"]["points"]
        ctx = c["decode_contexts"]
        parts.append(f"**{c['decode_arch']} incremental decoding, B={c['batch']}: ms per token after a context of "
                     f"L tokens** (median of {c['min_repeats']}–{c['decode_repeats']} tokens)\n\n" +
                     report.table(pts, ctx, lambda r: f"{r['median_s'] * 1e3:.1f}"))
        parts.append("**Incremental state of all layers (MiB)**\n\n" +
                     report.table(pts, ctx, lambda r: None if r.get("state_bytes") is None
                                  else f"{r['state_bytes'] / report.MiB:.2f}"))
    if "cross" in res:
        x = res["cross"]
        xc, src = x["config"], x["config"]["cross_sources"]
        parts.append(f"**{xc['cross_arch']} (LLN encoder, LAVO decoder) incremental decoding, B={xc['batch']}: ms per "
                     f"token after a source of S tokens, by cross-attention** (median of "
                     f"{xc['decode_repeats']} tokens, the source lengths' steps alternating; the encoder and the first "
                     f"step, which reads the source, are not timed; load at the start "
                     f"{', '.join(f'{v:.2f}' for v in x['load_start'])})\n\n" +
                     report.table(x["points"], src, lambda r: f"{r['median_s'] * 1e3:.2f}"))
        parts.append("**Incremental state of all layers, self- and cross-attention (MiB)**\n\n" +
                     report.table(x["points"], src, lambda r: None if r.get("state_bytes") is None
                                  else f"{r['state_bytes'] / report.MiB:.2f}"))
    return "\n\n".join(p for p in parts if p)


def plot(res: dict, path: Path) -> None:
    series = {}
    for part, label in (("train", "train"), ("decode", "decode"), ("cross", "cross-attention")):
        if part in res:
            series.update({f"{label} {METHODS_EXTRA[m].title if m in METHODS_EXTRA else m}": rows
                           for m, rows in res[part]["points"].items()})
    report.plot_loglog(series, path, "linattn_roberta_base update and linattn_lm_gpt decoding",
                       panels=(("median_s", "seconds per update / per token", 1.0),))


def main(argv=None):
    cli.run(parse_args(argv), argv, "model results", measure_all, plot, render)


if __name__ == "__main__":
    main()

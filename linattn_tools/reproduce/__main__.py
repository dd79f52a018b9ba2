"""Command line of the reproduction ledger (``scripts/reproduce.sh`` calls it).

    python -m linattn_tools.reproduce run [--only GROUP ...] [--reuse-quickstart]   # measure, then render
    python -m linattn_tools.reproduce render [--check]                              # from the JSON alone
    python -m linattn_tools.reproduce expected-time [--only GROUP ...]
"""
import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import (
    common,
    decoding,
    front_page,
    ledger,
    lln_cost,
    lln_distribution,
    quickstart,
    skyformer_error,
    skyformer_fig1,
)

# Wall time of each group when no earlier run of it is committed (seconds, on FALLBACK_CORES shared cores).
FALLBACK_SECONDS = {"lln_distribution": 240, "lln_cost": 300, "quickstart": 600, "skyformer_error": 120,
                    "skyformer_fig1": 900, "decoding": 1200}
FALLBACK_CORES = 2


def expected_seconds(groups: Sequence[str], directory: Path = common.RESULTS_DIR) -> Dict[str, float]:
    """Each group's wall time in the committed results (the last full run), else the fallback estimate."""
    done = ledger.load_results(directory)
    return {g: float(done[g]["wall_s"]) if g in done else float(FALLBACK_SECONDS[g]) for g in groups}


def expected_text(groups: Sequence[str], directory: Path = common.RESULTS_DIR) -> str:
    """The expected wall time, on the cores of the machine that wrote the committed runs."""
    done = ledger.load_results(directory)
    secs = expected_seconds(groups, directory)
    parts = ", ".join(f"{g} {s / 60:.0f} min" for g, s in secs.items())
    cores = sorted({done[g]["machine"]["cpu_count"] for g in groups if g in done and done[g].get("machine")})
    cores = cores or [FALLBACK_CORES]
    took = ", as the committed run took" if all(g in done for g in groups) else ""
    return (f"expected wall time about {sum(secs.values()) / 60:.0f} min on {'/'.join(map(str, cores))} CPU cores "
            f"({parts}){took}")


def _command(group: str, quick: bool) -> str:
    return f"bash scripts/reproduce.sh --only {group}" + (" --quick" if quick else "")


def run_groups(groups: Sequence[str], *, out: Path, quick: bool, reuse_quickstart: bool,
               quickstart_dir: Path, reuse_benchmark: bool = False) -> None:
    for group in groups:
        print(f"[reproduce] {group}", flush=True)
        if group == "lln_distribution":
            settings = dict(lln_distribution.QUICK if quick else lln_distribution.DEFAULTS)
            common.run_group(group, _command(group, quick), settings, lambda: lln_distribution.measure(**settings), out)
        elif group == "skyformer_error":
            settings = dict(skyformer_error.QUICK if quick else skyformer_error.DEFAULTS)
            common.run_group(group, _command(group, quick), settings, lambda: skyformer_error.measure(**settings), out)
        elif group == "skyformer_fig1":
            settings = dict(skyformer_fig1.QUICK if quick else skyformer_fig1.DEFAULTS)
            run_dir = Path(out) / "skyformer_fig1_runs" if quick else skyformer_fig1.RUN_DIR
            plot = Path(out) / "skyformer_fig1.png" if quick else skyformer_fig1.PLOT
            common.run_group(group, _command(group, quick), settings,
                             lambda: skyformer_fig1.measure(**settings, run_dir=run_dir, plot=plot), out)
        elif group == "decoding":
            settings = dict(decoding.QUICK if quick else decoding.DEFAULTS)
            common.run_group(group, _command(group, quick), settings, lambda: decoding.measure(**settings), out)
        elif group == "lln_cost":
            settings = dict(lln_cost.DEFAULTS, threads=1,
                            benchmark_json=str(lln_cost.RAW_JSON.relative_to(common.ROOT)),
                            memory_budget_gib=lln_cost.memory_budget_gib(),
                            measured_here="softmax, attention dropout 0.1, at the sizes listed; the other points "
                                          "from docs/benchmarks/model.json and model_attention_dropout.json")

            def measure_cost():
                if not (quick or reuse_benchmark):
                    lln_cost.run_softmax_dropout(settings["sizes"])
                return lln_cost.collect(settings["methods"])
            earlier = ledger.load_results(out).get(group) if reuse_benchmark else None
            command = _command(group, quick) + (", re-read with --reuse-benchmark" if reuse_benchmark else "")
            common.run_group(group, command, settings, measure_cost, out,
                             wall_s=earlier["wall_s"] if earlier else None)
        elif group == "quickstart":
            settings = {"run_dir": str(Path(quickstart_dir).resolve().relative_to(common.ROOT))
                        if Path(quickstart_dir).resolve().is_relative_to(common.ROOT) else str(quickstart_dir),
                        "script": "scripts/quickstart.sh", "config": "configs/quickstart.yaml",
                        "reused_run": reuse_quickstart}

            def measure_quickstart():
                if not reuse_quickstart:
                    quickstart.run_quickstart(Path(quickstart_dir))
                return quickstart.collect(Path(quickstart_dir))
            command = _command(group, False)
            if reuse_quickstart:
                command = (f"RUN={settings['run_dir']} bash scripts/quickstart.sh, read by {command} "
                           f"--reuse-quickstart")
            wall_s = quickstart.reported_wall_seconds(Path(quickstart_dir)) if reuse_quickstart else None
            common.run_group(group, command, settings, measure_quickstart, out, wall_s=wall_s)


def render(results: Path, ledger_path: Path, check: bool, readme: Optional[Path] = None) -> int:
    """Write (``check``: compare) the ledger and the README's results section, both from the JSON alone: ``readme``,
    else the README when ``results`` are the committed ones (a run elsewhere leaves the README alone)."""
    records = ledger.load_results(results)
    texts = {ledger_path: ledger.render(records)}
    if readme is None and Path(results).resolve() == common.RESULTS_DIR.resolve():
        readme = front_page.README
    if readme is not None:
        section = front_page.section(records, *ledger.claim_counts(records), front_page.load_gpu_targets())
        texts[readme] = front_page.replace(readme.read_text(), section)
    if check:
        stale = [path for path, text in texts.items() if (path.read_text() if path.is_file() else "") != text]
        for path in stale:
            print(f"{path} differs from what the JSON in {results} renders: run "
                  f"`bash scripts/reproduce.sh --render`", file=sys.stderr)
        if not stale:
            print(" and ".join(map(str, texts)) + " are up to date")
        return 1 if stale else 0
    for path, text in texts.items():
        path.write_text(text)
        print(f"[reproduce] wrote {path}")
    return 0


def main(argv: List[str] = None) -> int:
    everything = expected_text(common.GROUPS)
    p = argparse.ArgumentParser(prog="python -m linattn_tools.reproduce",
                                description=f"Reproduction ledger of the LLN, LAVO and Skyformer claims. A full "
                                            f"run: {everything}.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help=f"measure, write docs/reproduction/*.json, render the ledger ({everything})")
    run.add_argument("--only", nargs="+", choices=common.GROUPS, default=list(common.GROUPS))
    run.add_argument("--reuse-quickstart", action="store_true",
                     help="read an earlier quick-start run in --quickstart-dir instead of running it again")
    run.add_argument("--quickstart-dir", type=Path, default=quickstart.RUN_DIR)
    run.add_argument("--reuse-benchmark", action="store_true",
                     help=f"lln_cost: read {lln_cost.RAW_JSON.name} as measured before instead of measuring again")
    run.add_argument("--quick", action="store_true", help="tiny sizes (checks the code runs; not for the ledger)")
    run.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    run.add_argument("--ledger", type=Path, default=common.LEDGER)
    ren = sub.add_parser("render", help="rewrite the ledger from the JSON alone (seconds)")
    ren.add_argument("--results", type=Path, default=common.RESULTS_DIR)
    ren.add_argument("--ledger", type=Path, default=common.LEDGER)
    ren.add_argument("--readme", type=Path, help="its results section is rewritten too (default: README.md when "
                                                  "--results is the committed docs/reproduction/)")
    ren.add_argument("--check", action="store_true", help="exit 1 if the ledger differs from what the JSON renders")
    exp = sub.add_parser("expected-time", help="print the expected wall time")
    exp.add_argument("--only", nargs="+", choices=common.GROUPS, default=list(common.GROUPS))
    args = p.parse_args(argv)
    if args.command == "expected-time":
        print(expected_text(args.only))
        return 0
    if args.command == "render":
        return render(args.results, args.ledger, args.check, args.readme)
    print(f"[reproduce] {expected_text(args.only)}", flush=True)
    run_groups(args.only, out=args.out, quick=args.quick, reuse_quickstart=args.reuse_quickstart,
               quickstart_dir=args.quickstart_dir, reuse_benchmark=args.reuse_benchmark)
    return render(args.out, args.ledger, check=False)


if __name__ == "__main__":
    sys.exit(main())

"""What the two benchmark scripts share: output options, the allocator restart, and the
measure-or-load → JSON → plot → markdown sequence of their ``main``."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from . import measure, report


def write_json(path: Path, res: dict) -> None:
    """A benchmark's result as JSON at ``path``, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")


def add_output_arguments(p: argparse.ArgumentParser, section: str, default_json: Path, default_plot: Path,
                         malloc_default: str = "keep") -> None:
    """--malloc, --json, --plot, --docs, --from-json, --quick (the last given meaning by ``finish_args``)."""
    choices = ["keep", "default"] + (["both"] if malloc_default == "both" else [])
    p.add_argument("--malloc", choices=choices, default=None,
                   help="glibc's allocator (CPU only): keep: restart with glibc keeping freed memory (no page "
                        "faults on every large temporary, like a GPU's caching allocator), for every method; "
                        "default: glibc's"
                        + ("; both: measure with glibc's defaults (what a user runs), then time again in a "
                           "child process under keep (the second column)" if "both" in choices else "")
                        + f" [{malloc_default} on the CPU, default on a GPU: no restart, no second run]")
    p.set_defaults(malloc_cpu_default=malloc_default)
    p.add_argument("--json", type=Path, default=None, help=f"results (default {default_json}; none with --quick)")
    p.add_argument("--plot", type=Path, default=None, help=f"PNG (default {default_plot}; none with --quick)")
    p.add_argument("--docs", type=Path, default=None, help=f"rewrite the {section} section of this markdown")
    p.add_argument("--from-json", type=Path, default=None, help="render an earlier run, measure nothing")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    p.add_argument("--section", default=None,
                   help=f"name of the --docs section to rewrite (default: the {section} results)")


def finish_args(args: argparse.Namespace, quick: dict, default_json: Path, default_plot: Path) -> argparse.Namespace:
    """--quick overrides the sizes with ``quick`` and writes nothing by default; otherwise the defaults.

    The default plot goes to ``img/`` beside ``--docs`` when it is given (where the section links it).
    """
    if args.malloc is None:  # glibc's settings matter only for CPU tensors
        args.malloc = args.malloc_cpu_default if torch.device(getattr(args, "device", "cpu")).type == "cpu" \
            else "default"
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    else:
        args.json = args.json or default_json
        args.plot = args.plot or (args.docs.parent / "img" / default_plot.name if args.docs else default_plot)
    return args


def run(args: argparse.Namespace, argv: Optional[list], section: str, measure_all: Callable[[argparse.Namespace], dict],
        plot: Callable[[dict, Path], None], render: Callable[[dict, str], str]) -> None:
    """Measure (in a restarted process under --malloc keep) or load --from-json; write JSON, plot, section."""
    if args.malloc == "keep" and not args.from_json and argv is None:
        measure.restart_keeping_freed_memory(sys.argv)
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        res = measure_all(args)
        if args.malloc == "both" and argv is None and "malloc_second_column" not in res["machine"]:
            # a script's own process (the child re-runs sys.argv); isolated series bring their own keep times
            merge_keep_times(res, _measure_keep(sys.argv[1:]))
        if args.json:
            write_json(args.json, res)
            print(f"wrote {args.json}")
    if args.plot:
        plot(res, args.plot)
        print(f"wrote {args.plot}")
    text = render(res, report.link(args.plot, args.docs))
    print(text)
    if args.docs:
        report.write_section(args.docs, args.section or section, text)
        print(f"updated {args.docs}")


_OUTPUTS = ("--malloc", "--json", "--plot", "--docs", "--section")


def child_argv(argv: Sequence[str], drop: Sequence[str], drop_flags: Sequence[str] = ()) -> List[str]:
    """``argv`` without the options ``drop`` (each with its values, up to the next ``--option``) and the
    flags ``drop_flags``."""
    rest, skip = [], False
    for tok in argv:
        if tok.startswith("--"):
            skip = tok in drop
            if skip or tok.split("=", 1)[0] in drop or tok in drop_flags:
                continue
        if not skip:
            rest.append(tok)
    return rest


def run_child(args: Sequence[str], env: Optional[dict] = None, plot: bool = True) -> dict:
    """Run this tool again (``python -m`` the same module) with ``args`` (plus its own --json, and --plot if it
    takes one, in a temporary folder); its results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, *measure.own_command(), *args, "--json", str(out)]
        cmd += ["--plot", str(Path(tmp) / "child.png")] if plot else []
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        return json.loads(out.read_text())


def _measure_keep(argv: list) -> dict:
    """Run this script again (same options, no memory, no outputs) under ``--malloc keep``; its results."""
    return run_child(child_argv(argv, _OUTPUTS) + ["--malloc", "keep", "--no-memory"], measure.KEEP_FREED_MEMORY)


def merge_keep_times(res: dict, keep: dict) -> None:
    """Each measured row gets ``keep_median_s``, the median time of the same point under ``--malloc keep``."""
    res["machine"]["malloc_second_column"] = keep["machine"].get("malloc")
    for name, rows in res["points"].items():
        by_n = {r["n"]: r for r in keep["points"].get(name, []) if r["status"] == "ok"}
        for row in rows:
            if row["status"] == "ok" and row["n"] in by_n:
                row["keep_median_s"] = by_n[row["n"]]["median_s"]

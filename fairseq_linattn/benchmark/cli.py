"""What the two benchmark scripts share: output options, the allocator restart, and the
measure-or-load → JSON → plot → markdown sequence of their ``main``."""
import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

from . import measure, report


def add_output_arguments(p: argparse.ArgumentParser, section: str, default_json: Path, default_plot: Path) -> None:
    """--malloc, --json, --plot, --docs, --from-json, --quick (the last given meaning by ``finish_args``)."""
    p.add_argument("--malloc", choices=["keep", "default"], default="keep",
                   help="keep: restart with glibc keeping freed memory (no page faults on every large "
                        "temporary, like a GPU's caching allocator), for every method; default: glibc's")
    p.add_argument("--json", type=Path, default=None, help=f"results (default {default_json}; none with --quick)")
    p.add_argument("--plot", type=Path, default=None, help=f"PNG (default {default_plot}; none with --quick)")
    p.add_argument("--docs", type=Path, default=None, help=f"rewrite the {section} section of this markdown")
    p.add_argument("--from-json", type=Path, default=None, help="render an earlier run, measure nothing")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks the script runs")


def finish_args(args: argparse.Namespace, quick: dict, default_json: Path, default_plot: Path) -> argparse.Namespace:
    """--quick overrides the sizes with ``quick`` and writes nothing by default; otherwise the defaults.

    The default plot goes to ``img/`` beside ``--docs`` when it is given (where the section links it).
    """
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
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1))
            print(f"wrote {args.json}")
    if args.plot:
        plot(res, args.plot)
        print(f"wrote {args.plot}")
    text = render(res, report.link(args.plot, args.docs))
    print(text)
    if args.docs:
        report.write_section(args.docs, section, text)
        print(f"updated {args.docs}")

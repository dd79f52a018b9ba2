"""Scaling exponents, markdown tables, log-log plots and the generated section of docs/benchmarks.md."""
import math
import os
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

MiB = 2 ** 20


def scaling_exponent(rows: Sequence[dict], key: str, n_min: int, n_max: int) -> Optional[float]:
    """Least-squares slope of log(key) against log(N) over the measured rows with n_min <= N <= n_max."""
    pts = [(math.log(r["n"]), math.log(r[key])) for r in rows
           if r["status"] == "ok" and n_min <= r["n"] <= n_max and r.get(key)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _cell(row: dict, fmt: Callable[[dict], Optional[str]]) -> str:
    if row["status"] == "ok":
        return fmt(row) or "n/a"
    if row["status"] == "over budget":
        return f"over budget ({row['note']})"
    if row["status"] == "error":
        return "error"
    return "–" if not row.get("note") or row["note"].startswith(("over", "error")) else "skipped"


def table(series: Dict[str, List[dict]], sizes: List[int], fmt: Callable[[dict], Optional[str]],
          extra: Optional[Dict[str, Dict[str, str]]] = None) -> str:
    """One row per series, one column per N (LLN Table 2's layout), then the ``extra`` columns."""
    extra_names = list(next(iter(extra.values())).keys()) if extra else []
    head = ["method", *[f"{n:,}".replace(",", " ") for n in sizes], *extra_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in series.items():
        by_n = {r["n"]: r for r in rows}
        cells = [_cell(by_n[n], fmt) if n in by_n else "" for n in sizes]
        lines.append("| " + " | ".join([name, *cells, *(extra[name][k] for k in extra_names)]) + " |")
    return "\n".join(lines)


def fmt_exponent(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def plot_loglog(series: Dict[str, List[dict]], path: Path, title: str,
                panels: Sequence[tuple] = (("median_s", "time (s)", 1.0), ("peak_bytes", "peak memory (MiB)", MiB))):
    """One log-log panel per (key, label, divisor): the measured points of every series against N."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's logging set-up lets DEBUG through
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one colour per method, its causal form dashed in the same colour
    def base(name: str) -> str:
        return name.replace(" causal", "")

    methods = list(dict.fromkeys(base(name) for name in series))
    colour = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (key, label, divisor) in zip(axes[0], panels):
        for name, rows in series.items():
            pts = [(r["n"], r[key] / divisor) for r in rows if r["status"] == "ok" and r.get(key)]
            if pts:
                style = "--" if "causal" in name else "-"
                ax.loglog(*zip(*pts), style, color=colour[base(name)], marker="o", markersize=3,
                          label=name)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_lines(machine: dict, load: Sequence[float]) -> str:
    load_text = ", ".join(f"{x:.2f}" for x in load) if load else "n/a"
    return (f"Machine: {machine['cpu']} ({machine['cpu_count']} cores, {machine['cpu_capability']}), "
            f"torch {machine['torch']} on {machine['device']}, {machine['torch_threads']} threads, "
            f"Python {machine['python']}; load average (1, 5, 15 min) at the start: {load_text}."
            + (f" glibc malloc: {machine['malloc']} (freed memory kept, see below)." if machine.get("malloc")
               else " glibc malloc defaults." if "malloc" in machine else "")
            + (f" Times in brackets: a second process with {machine['malloc_second_column']} (freed memory kept)."
               if machine.get("malloc_second_column") else ""))


def targets_table(targets: List[dict]) -> str:
    lines = ["| target | measured | met |", "|---|---|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def link(image: Optional[Path], doc: Optional[Path]) -> str:
    """The image's path as seen from the markdown file that shows it ("" without an image)."""
    if image is None:
        return ""
    return os.path.relpath(image.resolve(), doc.resolve().parent) if doc else str(image)


def write_section(doc: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` (appended if absent)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = doc.read_text() if doc.exists() else ""
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)

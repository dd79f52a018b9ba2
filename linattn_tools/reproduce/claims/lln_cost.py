"""LLN Table 2: time and memory of a RoBERTa-base update against N, from ``lln_cost.json``."""
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...benchmark.fit import longest_n
from ...methods_extra import METHODS_EXTRA
from ...recipes import paper_results as pr
from .verdict import GiB, Verdict, cores, pct

LINEAR_EXPONENT = 1.1  # "scales linearly": time exponent at most 1.1
TIME_METHODS = ("lln", "lln_diag")
NAMES = {"lln": "LLN", "lln_diag": "LLN+Diag"}
LONG_N = 1024  # the time and memory-overhead tests use N >= 1024 (below, fixed costs dominate)
PAPER_TIME_COLUMNS = (4096, 8192, 16384)  # Table 2's N where LLN's time exponent is read
PAPER_SPEED_COLUMNS = (1024, 2048, 4096)  # Table 2's N where softmax has a time too


def memory_budget(rec: Dict) -> float:
    """Bytes an update may take in the longest-sequence claims: the measuring machine's memory, as the
    record's settings give it (``memory_budget_gib``)."""
    return rec["settings"]["memory_budget_gib"] * GiB


def _cost_points(rec: Dict, method: str, dropout: Optional[float] = None,
                 source: Optional[str] = None) -> List[Dict]:
    pts = [p for p in rec["results"]["points"] if p["method"] == method
           and (dropout is None or abs(p["attention_dropout"] - dropout) < 1e-9)
           and (source is None or p["source"] == source)]
    by_n = {}
    for p in pts:  # one point per N: the latest file listed wins (a re-measurement)
        by_n[p["n"]] = p
    return [by_n[n] for n in sorted(by_n)]


def power_exponent(ns: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log n."""
    xs, ls = [math.log(n) for n in ns], [math.log(y) for y in ys]
    mx, my = sum(xs) / len(xs), sum(ls) / len(ls)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ls)) / sum((x - mx) ** 2 for x in xs)


def memory_fit(rec: Dict, method: str, dropout: Optional[float]) -> Dict:
    """Fit total update memory against N: quadratic through every point when the attention stores N x N
    probabilities (softmax with dropout), else linear through the two longest measured N."""
    pts = _cost_points(rec, method, dropout)
    quadratic = method in METHODS_EXTRA and METHODS_EXTRA[method].dropout_keeps_matrix and dropout
    fit = longest_n([p["n"] for p in pts], [p["total_bytes"] for p in pts], memory_budget(rec),
                    bool(quadratic))
    used = [p for p in pts if p["n"] in fit["used"]]
    return {**fit, "measured": [p["n"] for p in pts], "largest": pts[-1],
            "sources": sorted({p["source"] for p in used}), "quadratic": bool(quadratic)}


def _fit_text(name: str, f: Dict) -> str:
    kind = "quadratic" if f["quadratic"] else "linear"
    return (f"{name}: ≈ {f['n_max']:,.0f} tokens ({kind} fit to N = "
            f"{', '.join(str(n) for n in f['used'])}, "
            f"largest measured {f['largest']['total_bytes'] / GiB:.1f} GiB at {f['largest']['n']})")


def _paper_longest(method: str) -> int:
    return max(n for n in pr.TABLES["lln_table2_memory"].columns if isinstance(pr.lln_memory(method, n), float))


def _paper_oom(method: str) -> int:
    """The shortest N at which Table 2 reports out-of-memory for ``method``."""
    return min(n for n in pr.TABLES["lln_table2_memory"].columns if pr.lln_memory(method, n) == pr.OOM)


def table2_longest(method: str, softmax_dropout: float) -> Callable[[Dict], Verdict]:
    def evaluate(rec: Dict) -> Verdict:
        lin, sm = memory_fit(rec, method, None), memory_fit(rec, "softmax", softmax_dropout)
        ratio = lin["n_max"] / sm["n_max"]
        paper_ratio = _paper_longest(method) / _paper_longest("softmax")
        name = NAMES[method]
        sm_name = ("softmax with attention dropout 0.1 (N × N probabilities kept for backward)" if softmax_dropout
                   else "softmax with attention dropout 0 (PyTorch's CPU SDPA flash kernel, O(N) memory)")
        sm_longest = _paper_longest("softmax")
        largest = max(p["total_bytes"] for p in rec["results"]["points"])
        return Verdict(
            paper=f"longest N in Table 2: softmax {sm_longest} ({pr.lln_memory('softmax', sm_longest)} GB; OOM at "
                  f"{_paper_oom('softmax')}), {name} ≥ {_paper_longest(method)} "
                  f"({pr.lln_memory(method, _paper_longest(method))} GB): ≥ {paper_ratio:.0f}× "
                  f"(§5.1: LLN handles at least four times longer sequences)",
            ours=f"longest N whose update fits in {memory_budget(rec) / GiB:.0f} GiB (extrapolated): "
                 f"{_fit_text(sm_name, sm)}; {_fit_text(name, lin)}; ratio {ratio:.1f}× "
                 f"(powers of two: {sm['grid_max']} vs {lin['grid_max']})",
            holds=ratio >= 4, test="our ratio of the longest N ≥ 4",
            cause=("a fused (flash) softmax kernel never stores the N × N matrix, so its memory grows linearly like "
                   f"LLN's; the paper's softmax stores it (its {pr.lln_memory('softmax', sm_longest)} GB at "
                   f"{sm_longest}), as ours does with attention dropout") if not softmax_dropout else
                  "softmax's quadratic term is smaller next to the rest of the model here than on the paper's GPU",
            note=f"extrapolated: no update above {largest / GiB:.1f} GiB was measured on this shared machine; "
                 f"memory = tensor bytes of "
                 f"parameters, Adam state and the update's peak (no allocator or framework overhead); sources: "
                 f"{', '.join(sorted(set(sm['sources'] + lin['sources'])))}; largest relative fit residual "
                 f"{max(sm['residual'], lin['residual']) * 100:.1f} %")
    return evaluate


def table2_diag_memory(rec: Dict) -> Verdict:
    lln, diag = {p["n"]: p for p in _cost_points(rec, "lln")}, {p["n"]: p for p in _cost_points(rec, "lln_diag")}
    common = [n for n in sorted(lln) if n in diag and n >= LONG_N]
    ours = {n: diag[n]["total_bytes"] / lln[n]["total_bytes"] - 1 for n in common}
    paper = {n: pr.lln_memory("lln_diag", n) / pr.lln_memory("lln", n) - 1
             for n in pr.TABLES["lln_table2_memory"].columns
             if isinstance(pr.lln_memory("lln", n), float) and n >= LONG_N}
    limit = max(paper.values())
    return Verdict(
        paper="LLN+Diag adds about 10 % memory over LLN (§5.1); Table 2: " +
              ", ".join(f"{pct(v)} at {n}" for n, v in paper.items()),
        ours="update memory (parameters, Adam state, peak): "
             + ", ".join(f"{pct(v)} at {n}" for n, v in ours.items()),
        holds=max(ours.values()) <= limit + 1e-9,
        test=f"our overhead at every measured N ≥ {LONG_N} at most the paper's largest in Table 2 "
             f"({limit * 100:.0f} %)",
        cause="the diagonal blocks (block = head dim = 64) keep a softmax's probabilities and inputs per block: "
              "on a CPU, without a fused block kernel, that is as much as LLN's own saved features")


def time_source(rec: Dict) -> str:
    """The result file the time exponents come from: the one run (one machine load) holding the most
    LLN and LLN+Diag points at N ≥ LONG_N (the first listed of equals)."""
    counts: Dict[str, int] = {}
    for p in rec["results"]["points"]:
        if p["method"] in TIME_METHODS and p["n"] >= LONG_N:
            counts[p["source"]] = counts.get(p["source"], 0) + 1
    return max(counts, key=counts.get)


def table2_time_linear(rec: Dict) -> Verdict:
    exps, source = {}, time_source(rec)
    for m in TIME_METHODS:
        pts = [p for p in _cost_points(rec, m, source=source) if p["n"] >= LONG_N]
        exps[m] = (power_exponent([p["n"] for p in pts], [p["seconds"] for p in pts]), pts[0]["n"], pts[-1]["n"])
    cols = list(PAPER_TIME_COLUMNS)
    paper = {m: power_exponent(cols, [pr.lln_speed(m, n) for n in cols]) for m in exps}
    return Verdict(
        paper=f"LLN scales linearly with the sequence length (§5.1); Table 2 time exponent {cols[0]}–{cols[-1]}: "
              f"LLN {paper['lln']:.2f}, LLN+Diag {paper['lln_diag']:.2f}",
        ours="update time exponent " + ", ".join(f"{NAMES[m]} {e:.2f} (N = {a}–{b})" for m, (e, a, b) in exps.items()),
        holds=all(e <= LINEAR_EXPONENT for e, _, _ in exps.values()),
        test=f"least-squares exponent of time against N ≤ {LINEAR_EXPONENT} for both",
        note=f"times from {source} (one run)",
        cause="the model's quadratic-free parts dominate only from moderate N; at small N fixed costs flatten "
              "the curve, at large N the allocator and caches steepen it")


def _same_run_ratios(rec: Dict, method: str) -> List[Tuple[int, float, str]]:
    """(N, softmax time / method time, source) for softmax with attention dropout 0.1 and ``method``
    measured at the same N in the same file (one machine load)."""
    out = []
    for sm in _cost_points(rec, "softmax", 0.1):
        other = [p for p in _cost_points(rec, method, source=sm["source"]) if p["n"] == sm["n"]]
        if other:
            # the fastest of the repeats: the one least slowed by other jobs on the machine
            fastest = sm.get("min_seconds", sm["seconds"]) / other[0].get("min_seconds", other[0]["seconds"])
            out.append((sm["n"], fastest, sm["source"]))
    return sorted(out)


def _load_range(rec: Dict, sources) -> str:
    loads = [p["load"] for p in rec["results"]["points"] if p["source"] in sources and p.get("load") is not None]
    return f"{min(loads):.1f}–{max(loads):.1f}" if loads else "not recorded"


def table2_speed(rec: Dict) -> Verdict:
    diag, lln = _same_run_ratios(rec, "lln_diag"), _same_run_ratios(rec, "lln")
    paper = {m: {n: pr.lln_speed("softmax", n) / pr.lln_speed(m, n) for n in PAPER_SPEED_COLUMNS}
             for m in ("lln_diag", "lln")}
    grows = all(a[1] < b[1] for a, b in zip(diag, diag[1:]))

    def text(rows):
        return ", ".join(f"{r:.2f}× at {n}" for n, r, _ in rows)
    without_lln = sorted({n for n, _, _ in diag} - {n for n, _, _ in lln})
    missing = (f"; the committed {', '.join(map(str, without_lln))} point{'s have' if len(without_lln) > 1 else ' has'}"
               " no LLN") if without_lln else ""
    loads = _load_range(rec, {s for _, _, s in diag})
    return Verdict(
        paper="Table 2, softmax time / LLN+Diag time: "
              + ", ".join(f"{v:.2f}× at {n}" for n, v in paper["lln_diag"].items())
              + "; / LLN: " + ", ".join(f"{v:.2f}× at {n}" for n, v in paper["lln"].items()),
        ours=f"softmax (attention dropout 0.1) / LLN+Diag update time (fastest repeat): {text(diag)}; "
             f"/ LLN: {text(lln)}",
        holds=len(diag) >= 2 and diag[-1][1] > 1 and grows,
        test="LLN+Diag faster than softmax at the longest N measured with both, and its advantage growing with N "
             "over at least two lengths (ratios of updates measured in the same run)",
        cause=f"wall-clock times on a {cores(rec)} machine shared with other jobs (1-minute load average "
              f"{loads} at these points) move by more than the differences "
              "between methods at short N; beyond that, outside attention the update is the same for every method "
              "(feed-forward, projections, vocabulary head, Adam), and on a CPU it dominates at these lengths",
        note="sources: " + ", ".join(sorted({s for _, _, s in diag + lln})) + missing + "; times are wall clock, "
             f"and the 1-minute load average of the {cores(rec)} machine at these points was {loads}")

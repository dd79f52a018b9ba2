"""LLN Table 2 and LAVO Tables 2 and 10 judged on a GPU model benchmark (``gpu_speed.record``).

Until a GPU benchmark JSON is committed, every row here holds nothing and says so; the CPU rows
(``lln-table2-speed``, ``lavo-table10-*``) stand meanwhile."""
from typing import Dict, List

from ...recipes import paper_results as pr
from ..gpu_speed import describe
from .verdict import Verdict

LLN_SIZES = (4096, 8192, 16384)  # LLN Table 2's long end
LAVO_LONGEST = 16384


def _missing(paper: str, cpu_rows: str) -> Verdict:
    return Verdict(paper=paper, ours=f"no GPU benchmark committed yet (a `python -m linattn_tools.benchmark.model "
                                     f"--device cuda` JSON in docs/benchmarks/); {cpu_rows}",
                   holds=None, test="judged once a GPU benchmark JSON is committed")


def _times(rec: Dict, part: str, method: str) -> Dict[int, float]:
    section = rec.get(part) or {}
    return {int(p["n"]): float(p["median_s"]) for p in section.get("points", {}).get(method, [])
            if p.get("status") == "ok" and p.get("median_s") is not None}


def _note(rec: Dict, what: str) -> str:
    c = rec["config"]
    arch = c.get(f"{what}_arch", "?")
    return (f"GPU run: {describe(rec)} ({rec['source']}); {arch}, batch {c.get('batch', '?')}, attention dropout "
            f"{c.get('attention_dropout', '?')}; median time per {'update' if what == 'train' else 'token'}")


def lln_speed_gpu(rec: Dict) -> Verdict:
    sm_paper = {n: pr.lln_speed("softmax", n) for n in LLN_SIZES}
    paper = ("Table 2 (GPU), softmax time / LLN time: "
             + ", ".join(f"{sm_paper[n] / pr.lln_speed('lln', n):.2f}× at {n}" if isinstance(sm_paper[n], float)
                         else f"softmax {sm_paper[n]} at {n}" for n in LLN_SIZES))
    if not rec.get("source"):
        return _missing(paper, "the CPU row lln-table2-speed stands meanwhile")
    sm, lln = _times(rec, "train", "softmax"), _times(rec, "train", "lln")
    both = sorted(n for n in sm if n in lln and n >= 1024)
    ratios = {n: sm[n] / lln[n] for n in both}
    only_lln = [n for n in sorted(lln) if n >= LLN_SIZES[0] and n not in sm]
    ours = ", ".join(f"{r:.2f}× at {n}" for n, r in ratios.items()) or "no length measured with both"
    if only_lln:
        ours += f"; LLN alone (softmax not measured or failed) at {', '.join(map(str, only_lln))}"
    holds = bool(both) and ratios[both[-1]] > 1 and all(ratios[a] < ratios[b] for a, b in zip(both, both[1:]))
    return Verdict(paper=paper, ours="softmax / LLN update time: " + ours, holds=holds,
                   test="LLN faster than softmax at the longest N measured with both (N ≥ 1024), its advantage "
                        "growing with N",
                   cause="see the times in the GPU benchmark JSON: a fused softmax kernel (SDPA) on a GPU is fast "
                         "at these lengths" if not holds else "",
                   note=_note(rec, "train"))


def lavo_speed_gpu(rec: Dict) -> Verdict:
    lavo, flash = pr.pg19_speedup("lavo", 2), pr.pg19_speedup("softmax", 2)
    paper = (f"Table 2 at {LAVO_LONGEST}: LAVO {lavo}× and FlashAttention {flash}× over vanilla, so LAVO / "
             f"FlashAttention {lavo / flash:.2f}× (our softmax is SDPA, FlashAttention's row)")
    if not rec.get("source"):
        return _missing(paper, "no CPU row times LAVO training")
    sm, lv = _times(rec, "train", "softmax"), _times(rec, "train", "lavo")
    n = max((m for m in sm if m in lv), default=None)
    if n is None:
        return Verdict(paper=paper, ours="the GPU benchmark has no length timed with both softmax and LAVO",
                       holds=None, test="judged when both are timed", note=_note(rec, "train"))
    ratio = sm[n] / lv[n]
    holds = n >= LAVO_LONGEST and ratio > 1
    return Verdict(paper=paper, ours=f"softmax / LAVO update time at {n}: {ratio:.2f}×", holds=holds,
                   test=f"LAVO faster than softmax at N = {LAVO_LONGEST}",
                   cause=(f"longest length timed with both is {n}" if n < LAVO_LONGEST else
                          f"softmax (SDPA) is {1 / ratio:.2f}× as fast as LAVO at {n} here") if not holds else "",
                   note=_note(rec, "train") + "; the model is linattn_roberta_base, not LAVO's 12-layer GPT-2 LM")


def generation_totals(steps: Dict[int, float], length: int) -> float:
    """Time to generate ``length`` tokens from per-token times at measured contexts: the trapezoid rule
    over the contexts up to ``length``, the first measured time standing for the shorter contexts."""
    ns = sorted(n for n in steps if n <= length)
    if not ns or ns[-1] != length:
        raise ValueError(f"no step time at context {length}")
    total = ns[0] * steps[ns[0]]
    for a, b in zip(ns, ns[1:]):
        total += (b - a) * (steps[a] + steps[b]) / 2
    return total


def lavo_generation_gpu(rec: Dict) -> Verdict:
    lengths = [int(pr.PG19_TRAIN_CONTEXT * f) for f in pr.PG19_FACTORS]
    paper = "LAVO over vanilla attention: " + ", ".join(
        f"{pr.generation_speedup('lavo', f):.2f}× at {int(pr.PG19_TRAIN_CONTEXT * f)}" for f in pr.PG19_FACTORS)
    if not rec.get("source"):
        return _missing(paper + " (Table 10)", "the CPU rows lavo-table10-trend and lavo-table10-8k stand meanwhile")
    sm, lv = _times(rec, "decode", "softmax"), _times(rec, "decode", "lavo")
    common: List[int] = sorted(n for n in sm if n in lv)
    speedups = {n: generation_totals(sm, n) / generation_totals(lv, n) for n in common}
    if not speedups:
        return Verdict(paper=paper, ours="the GPU benchmark has no context decoded with both softmax and LAVO",
                       holds=None, test="judged when both are timed", note=_note(rec, "decode"))
    longest = max(speedups)
    target = lengths[0]
    holds = target in speedups and speedups[target] >= pr.generation_speedup("lavo", 1) and \
        all(speedups[a] < speedups[b] for a, b in zip(common, common[1:]) if a >= 2048)
    return Verdict(
        paper=paper + " (Table 10)",
        ours="softmax / LAVO time to generate L tokens (trapezoid over the per-token times at the measured "
             "contexts): " + ", ".join(f"{speedups[n]:.2f}× at {n}" for n in common),
        holds=holds,
        test=f"speed-up at L = {target} at least the paper's, and growing with L from 2048",
        cause=(f"at {longest} the speed-up is {speedups[longest]:.2f}×: see the per-token times in the GPU "
               f"benchmark JSON") if not holds else "",
        note=_note(rec, "decode") + "; softmax keeps a key/value cache, filled with random keys and values")

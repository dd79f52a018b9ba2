"""LAVO Table 10: generating token by token, from ``decoding.json``."""
from typing import Dict

from ...recipes import paper_results as pr
from .verdict import Verdict


def _gen(rec: Dict, method: str, key: str = "cpu_seconds") -> Dict[int, float]:
    """Seconds spent generating the first L tokens: CPU time of the steps (the record's thread count; the
    waits for a core on a shared machine left out) or, with key="seconds", wall-clock time."""
    return {int(k): v for k, v in rec["results"]["runs"][method][key].items()}


def _speedups(rec: Dict, method: str) -> Dict[int, float]:
    sm, m = _gen(rec, "softmax"), _gen(rec, method)
    return {n: sm[n] / m[n] for n in sorted(m) if n in sm}


def _paper_lengths() -> str:
    return ", ".join(str(int(pr.PG19_TRAIN_CONTEXT * f)) for f in pr.PG19_FACTORS)


def _gen_note(rec: Dict) -> str:
    s, r = rec["settings"], rec["results"]
    return (f"{s['arch']} with {s['layers']} layers and a {s['vocab']}-word dictionary (GPT-2's layer width "
            f"and the same share of output projection per layer as the 12-layer, 50,257-word model; "
            f"{r['parameters']['lavo'] / 1e6:.0f}M parameters with LAVO), random weights, batch 1, greedy, fp32 on "
            f"{r['threads']} CPU thread(s); softmax keeps a key/value cache; the paper uses the 12-layer GPT-2 at "
            f"{_paper_lengths()} tokens on a GPU")


def _paper_gen(method: str) -> str:
    return ", ".join(f"{pr.generation_speedup(method, f):.2f}× at {int(pr.PG19_TRAIN_CONTEXT * f)}"
                     for f in pr.PG19_FACTORS)


def table10_trend(rec: Dict) -> Verdict:
    sp = _speedups(rec, "lavo")
    ns = sorted(sp)
    grows = all(sp[a] < sp[b] for a, b in zip(ns, ns[1:]))
    times = _gen(rec, "softmax"), _gen(rec, "lavo")
    wall = _gen(rec, "softmax", "seconds"), _gen(rec, "lavo", "seconds")
    return Verdict(
        paper=f"LAVO over vanilla attention: {_paper_gen('lavo')} (Table 10)",
        ours="total CPU time softmax / LAVO: "
             + ", ".join(f"{sp[n]:.2f}× at {n} ({times[0][n]:.0f} s / {times[1][n]:.0f} s)" for n in ns)
             + "; wall clock: " + ", ".join(f"{wall[0][n] / wall[1][n]:.2f}× at {n}" for n in ns),
        holds=sp[ns[-1]] > 1 and grows, test="LAVO faster at the longest L, and its speed-up growing with L",
        cause="per token, the feed-forward layers and the output projection cost the same for every attention "
              "and dominate at batch 1 on a CPU", note=_gen_note(rec))


def table10_magnitude(rec: Dict) -> Verdict:
    sp = _speedups(rec, "lavo")
    n = max(sp)
    paper = pr.generation_speedup("lavo", 1)
    return Verdict(
        paper=f"LAVO over vanilla attention at {pr.PG19_TRAIN_CONTEXT}: {paper}× (Table 10)",
        ours=f"{sp[n]:.2f}× at {n}", holds=n >= pr.PG19_TRAIN_CONTEXT and sp[n] >= paper,
        test=f"our speed-up at L = {pr.PG19_TRAIN_CONTEXT} at least the paper's",
        cause=_magnitude_cause(rec), note=_gen_note(rec))


def _magnitude_cause(rec: Dict) -> str:
    sm, lavo = _gen(rec, "softmax"), _gen(rec, "lavo")
    n0, n1 = min(sm), max(sm)
    per = {name: (t[n0] / n0 * 1e3, (t[n1] - t[n0]) / (n1 - n0) * 1e3)
           for name, t in (("softmax", sm), ("LAVO", lavo))}
    return (f"per token, LAVO costs about the same at every length ({per['LAVO'][0]:.1f} ms CPU over the first {n0} "
            f"tokens, {per['LAVO'][1]:.1f} ms from {n0} to {n1}), and so does softmax early on "
            f"({per['softmax'][0]:.1f} ms), growing to {per['softmax'][1]:.1f} ms per token from {n0} to {n1} as its "
            f"cache grows: the feed-forward layers, projections and output layer, the same for every attention, are "
            f"most of a step on a CPU at batch 1; on the paper's GPU they take little time per token, so the "
            f"cache's cost weighs more")


def lln_generation(rec: Dict) -> Verdict:
    sp = _speedups(rec, "lln")
    return Verdict(paper="— (the LLN paper does not measure generation)",
                   ours="total CPU time softmax / LLN: " + ", ".join(f"{v:.2f}× at {n}" for n, v in sp.items()),
                   holds=None, test="information only", note=_gen_note(rec))

"""GPU self-test: what to run first on a CUDA machine (``bash scripts/gpu_selftest.sh``, ~5 minutes).

1. attention: every method of ``linattn.methods`` in every role it declares (encoder,
   causal decoder, cross), its module's ``attend`` (forward and input gradients; padded batch rows,
   compared on their valid rows) on the GPU in float32, float16 and bfloat16, against the module's
   ``reference`` (its op's materialised formula) in float64 on the CPU with the same (rounded) inputs;
2. training: 50 ``--fp16`` updates of the sample recipes (``pretrain_wikitext103.sh`` for every
   encoder attention, ``train_pg19.sh`` for every causal one; ``DEVICE=gpu SAMPLE=1``), each judged
   by the ``loss`` and ``loss_scale`` it wrote to TensorBoard: finite losses and a loss scale that
   never fell below ``--min-loss-scale`` (fp16 overflows halve it; LLN Appendix A.8.1 reads its
   inverse as the stability signal);
3. benchmark: ``python -m linattn_tools.benchmark.attention`` at N = 4096 on the GPU (timed between CUDA
   events);
4. one line: ``gpu_selftest: PASS`` or ``gpu_selftest: FAIL`` with what failed.

Without a CUDA device it stops at once with one line and exit status 2 (1 = a check failed).
Work files (logs, TensorBoard, benchmark JSON) go to ``--work`` [runs/gpu_selftest].
"""
import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from linattn.tolerances import tolerance

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "float16", "bfloat16")
# small settings so that blocks, chunks, windows and landmarks all come into play at N = 200
SMALL = dict(lln_chunk_size=16, lln_diag_block_size=16, skyformer_landmarks=16, lavo_window=8)
NO_GPU = "gpu_selftest: no CUDA device (torch.cuda.is_available() is False); this self-test needs a GPU"


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (as tests/conftest.py)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def op_cases(heads: int, head_dim: int, seed: int = 0) -> Dict[str, Callable]:
    """{"method role": fn(q, k, v, key_padding_mask, ref=False) -> output}: the module's ``attend`` on the
    inputs' device (parameters in float32), or with ``ref`` its ``reference`` on a float64 copy."""
    import copy

    import torch

    from fairseq_linattn.modules import build_attention
    from linattn.methods import METHODS

    torch.manual_seed(seed)
    cases = {}
    for name, method in METHODS.items():
        for role in method.roles:
            module = build_attention(name, heads * head_dim, heads, causal=role == "decoder", cross=role == "cross",
                                     config=SMALL).eval()
            reference = copy.deepcopy(module).double()
            placed = {}

            def run(q, k, v, mask, ref=False, module=module, reference=reference, placed=placed):
                if ref:
                    return reference.reference(q, k, v, mask)
                if q.device not in placed:
                    placed[q.device] = copy.deepcopy(module).to(q.device)
                m = placed[q.device]
                return m.attend(q, k if m.uses_keys else None, v, mask)
            run.method = module.method
            cases[f"{name} {role}"] = run
    return cases


def check_ops(device: str, dtypes=DTYPES, batch: int = 2, heads: int = 3, n: int = 200, head_dim: int = 32,
              seed: int = 0, cases: Optional[Dict[str, Callable]] = None) -> List[dict]:
    """Every case on ``device`` in each dtype against its reference in float64 on the CPU: one row per (case, dtype)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    gen = torch.Generator().manual_seed(seed)
    cases = cases or op_cases(heads, head_dim)
    mask = torch.zeros(batch, n, dtype=torch.bool)
    mask[1:, n - 37:] = True  # the other rows padded at the end
    rows = []
    for name, run in cases.items():
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3))
            cot = torch.randn(batch, heads, n, head_dim, generator=gen) * ~mask[:, None, :, None]
            row = {"op": name, "dtype": dtype_name, "ok": False, "error": None}
            try:
                ref_in = [t.double().requires_grad_() for t in (q, k, v)]
                want = run(*ref_in, mask, ref=True)
                want_grads = torch.autograd.grad(want, ref_in, cot.double(), allow_unused=True)
                dev_in = [t.to(device).requires_grad_() for t in (q, k, v)]
                got = run(*dev_in, mask.to(device))
                got_grads = torch.autograd.grad(got, dev_in, cot.to(device=device, dtype=got.dtype), allow_unused=True)
                method = getattr(run, "method", "softmax")
                tol, grad_tol = tolerance(method, dtype_name), tolerance(method, dtype_name, gradient=True)
                row["out_err"] = rel_err(got.cpu().transpose(1, 2)[~mask], want.transpose(1, 2)[~mask])
                row["grad_err"] = max((rel_err(g.cpu(), w) for g, w in zip(got_grads, want_grads) if w is not None),
                                      default=0.0)
                same_none = all((g is None) == (w is None) for g, w in zip(got_grads, want_grads))
                row["ok"] = (got.dtype == dtype and same_none and row["out_err"] <= tol
                             and row["grad_err"] <= grad_tol)
                row["tol"] = tol
            except Exception as exc:  # a crash is a failure of that case, not of the self-test
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rows.append(row)
    return rows


def read_scalars(tb_dir: Path, tag: str) -> List[tuple]:
    """[(step, value)] of a TensorBoard scalar in every event file under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for events in sorted({p.parent for p in Path(tb_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            points += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(points)


def judge_training(tb_dir: Path, min_loss_scale: float) -> dict:
    """Finite losses and a loss scale that stayed at or above ``min_loss_scale`` (fairseq's per-update
    ``train_inner`` TensorBoard records)."""
    losses = [v for _, v in read_scalars(Path(tb_dir) / "train_inner", "loss")]
    scales = [v for _, v in read_scalars(Path(tb_dir) / "train_inner", "loss_scale")]
    out = {"updates": len(losses), "first_loss": losses[0] if losses else None,
           "last_loss": losses[-1] if losses else None, "min_loss_scale": min(scales) if scales else None,
           "scale_drops": sum(b < a for a, b in zip(scales, scales[1:]))}
    if not losses or not scales:
        out["problem"] = "no loss or loss_scale in TensorBoard (was --fp16 on?)"
    elif not all(math.isfinite(v) for v in losses):
        out["problem"] = "non-finite loss"
    elif out["min_loss_scale"] < min_loss_scale:
        out["problem"] = f"loss scale fell to {out['min_loss_scale']:g} (< {min_loss_scale:g})"
    out["ok"] = "problem" not in out
    return out


def run_training(kind: str, attention: str, work: Path, updates: int, min_loss_scale: float,
                 device: str = "gpu") -> dict:
    """One ``--fp16`` sample recipe on one GPU, then its TensorBoard judged (``device="cpu"``: the
    recipes' CPU path, without fp16, for the tests)."""
    script = {"encoder": "pretrain_wikitext103.sh", "lm": "train_pg19.sh"}[kind]
    out = work / "train" / f"{kind}_{attention}"
    env = {**os.environ, "DEVICE": device, "SAMPLE": "1", "FP16": "1", "GPUS_PER_NODE": "1", "NNODES": "1",
           "OUT": str(out), "TB": str(out / "tb"), "SAMPLE_DATA": str(work / "data")}
    extra = ["--max-update", str(updates), "--warmup-updates", str(max(1, updates // 10)), "--log-interval", "1",
             "--seed", "1", "--no-save"]
    if kind == "encoder":
        extra += ["--total-num-update", str(updates)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "selftest.log", "w") as log:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / script), attention, *extra], env=env, cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT)
    row = {"run": f"{kind} {attention}", "log": str(out / "selftest.log")}
    if proc.returncode != 0:
        return {**row, "ok": False, "problem": f"{script} exited {proc.returncode}"}
    return {**row, **judge_training(out / "tb", min_loss_scale)}


def run_benchmark(work: Path, size: int, device: str = "cuda") -> List[dict]:
    """``python -m linattn_tools.benchmark.attention`` at N = ``size`` on CUDA; one row per series (method, causal)."""
    import json

    result = work / "benchmark_attention.json"
    cmd = [sys.executable, "-m", "linattn_tools.benchmark.attention", "--device", device, "--sizes", str(size),
           "--repeats", "5", "--json", str(result), "--plot", str(work / "benchmark_attention.png")]
    with open(work / "benchmark.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result.is_file():
        return [{"series": "benchmark_attention.py", "ok": False, "status": f"exit {proc.returncode}"}]
    points = json.loads(result.read_text())["points"]
    rows = []
    for series, pts in points.items():
        p = next((p for p in pts if p["n"] == size), {"status": "missing"})
        rows.append({"series": series, "ok": p["status"] == "ok", "status": p["status"],
                     "ms": 1e3 * p["median_s"] if p.get("median_s") else None,
                     "peak_mib": p["peak_bytes"] / 2 ** 20 if p.get("peak_bytes") else None})
    return rows


def summary_line(parts: Dict[str, List[dict]], seconds: float) -> str:
    """``gpu_selftest: PASS|FAIL (ops a/b, ...) in S s``, naming what failed."""
    counts = ", ".join(f"{name} {sum(r['ok'] for r in rows)}/{len(rows)}" for name, rows in parts.items())
    failed = [r.get("op", r.get("run", r.get("series"))) + (f" {r['dtype']}" if "dtype" in r else "")
              for rows in parts.values() for r in rows if not r["ok"]]
    ok = not failed and all(parts.values())
    tail = f"; failed: {', '.join(failed[:12])}{' ...' if len(failed) > 12 else ''}" if failed else ""
    return f"gpu_selftest: {'PASS' if ok else 'FAIL'} ({counts}) in {seconds:.0f} s{tail}"


def _fmt(value, spec=".2e") -> str:
    return "—" if value is None else format(value, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_selftest.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("ops", "train", "bench"), default=["ops", "train", "bench"])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu_selftest")
    parser.add_argument("--updates", type=int, default=50, help="fp16 updates per training run")
    parser.add_argument("--min-loss-scale", type=float, default=1.0,
                        help="a run fails if its fp16 loss scale fell below this (fairseq starts at 128)")
    parser.add_argument("--bench-size", type=int, default=4096)
    args = parser.parse_args(argv)

    import torch  # after --help

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"[gpu_selftest] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"work files in {args.work}", flush=True)
    parts: Dict[str, List[dict]] = {}
    if "ops" in args.parts:
        parts["ops"] = check_ops("cuda")
        for r in parts["ops"]:
            print(f"[ops] {r['op']:<22} {r['dtype']:<9} out {_fmt(r.get('out_err'))} grad {_fmt(r.get('grad_err'))} "
                  f"(tol {_fmt(r.get('tol'), '.0e')}) {'ok' if r['ok'] else 'FAIL ' + (r['error'] or '')}", flush=True)
    if "train" in args.parts:
        from linattn.methods import methods_for

        parts["fp16 training"] = []
        for kind, names in (("encoder", methods_for("encoder")), ("lm", methods_for("decoder"))):
            for name in names:
                r = run_training(kind, name, args.work, args.updates, args.min_loss_scale)
                parts["fp16 training"].append(r)
                print(f"[train] {r['run']:<20} updates {r.get('updates', '—')} "
                      f"loss {_fmt(r.get('first_loss'), '.3f')} -> {_fmt(r.get('last_loss'), '.3f')} "
                      f"min loss_scale {_fmt(r.get('min_loss_scale'), 'g')} "
                      f"({r.get('scale_drops', '—')} drops) {'ok' if r['ok'] else 'FAIL: ' + r['problem']} "
                      f"[{r['log']}]", flush=True)
    if "bench" in args.parts:
        parts[f"benchmark N={args.bench_size}"] = run_benchmark(args.work, args.bench_size)
        for r in parts[f"benchmark N={args.bench_size}"]:
            print(f"[bench] {r['series']:<22} {r['status']:<12} {_fmt(r.get('ms'), '.2f')} ms "
                  f"peak {_fmt(r.get('peak_mib'), '.0f')} MiB", flush=True)
    line = summary_line(parts, time.time() - started)
    print(line)
    return 0 if line.startswith("gpu_selftest: PASS") else 1


if __name__ == "__main__":
    sys.exit(main())

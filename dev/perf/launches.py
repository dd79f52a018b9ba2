"""The Triton launches of one attention module's training step, recorded on the CPU without running them: each
launch's kernel, grid, launch options, constexprs and, per argument, its tensor's shape, strides, dtype and
storage offset or its scalar, with the specialisation Triton's JIT gives that argument on a GPU (a pointer 16-byte
aligned or an integer divisible by 16: ``tt.divisibility = 16``; an integer equal to 1: a constant), computed by
the installed Triton's own ``native_specialize_impl`` from the real argument.

The step runs under Triton's interpreter with every launch replaced by a recorder (the wrappers around the kernels,
their layouts, checks and allocations still run; the moment matcher's ``_scales`` outputs set to 1, as
``host_time.stub_launches`` does), at a training shape (fairseq's packed q, k, v: head stride 3D). Both
``kernel_resources`` (each kernel's specialisation, ``--specialisation``: ``SPECIALISATION``) and ``predict`` (each
step's launches at the targets' shapes) read it. ``--root DIR`` records an earlier commit's tree (``git archive``
into DIR): its ``linattn`` and ``fairseq_linattn`` are imported from there.

    python -m dev.perf.launches --specialisation dev/perf/specialisation.json
    python -m dev.perf.launches --series lln:causal --n 2048 --json runs/launches.json
"""
import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional

SPECIALISATION = Path(__file__).with_name("specialisation.json")
# the targets' series (linattn_tools.benchmark.targets.TARGETS) and LAVO non-causal (its kernels' ORDERED builds)
SERIES = (("lln", False), ("lln", True), ("lln_diag", False), ("lln_diag", True), ("skyformer", False),
          ("lavo", True), ("lavo", False))
SCALES_KERNEL = "_scales"  # the moment matcher's kernel whose scales (checked > 0 downstream) the recorder sets to 1
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "maxnreg")


def function(fn) -> str:
    """A kernel's name as the records give it: its module and function, ``linattn.ops.triton.lln_causal._states``."""
    return f"{fn.__module__}.{fn.__name__}"


def _value(v):
    """A constexpr's value as JSON holds it: a Triton dtype by its name, numbers and flags as they are."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return {"dtype": str(v)}


def describe(kernel, grid, args, kwargs) -> dict:
    """One launch as recorded: function, grid, options, constexprs and the runtime arguments (tensors by shape,
    strides, dtype, element size, storage offset; scalars by value), each with its specialisation (``spec``: "D" for
    ``tt.divisibility = 16``, "" for none, or {"constant": v} where the JIT makes it a constant)."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(kernel.fn).parameters
    options = {k: v for k, v in kwargs.items() if k not in params}
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    if callable(grid):
        grid = grid(dict(bound.arguments))
    grid = [int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))]
    skip = set(getattr(kernel, "do_not_specialize", ()) or ())
    constexprs, arguments = {}, {}
    for index, (name, param) in enumerate(params.items()):
        if "constexpr" in str(param.annotation):
            constexprs[name] = _value(bound.arguments.get(name, param.default))
            continue
        arg = bound.arguments.get(name, param.default)
        specialise = name not in skip and index not in skip
        kind, spec = native_specialize_impl(BaseBackend, arg, False, specialise, specialise)
        spec = {"constant": _value(spec)} if kind == "constexpr" else (spec or "")
        if isinstance(arg, torch.Tensor):
            arguments[name] = dict(tensor=dict(shape=list(arg.shape), stride=list(arg.stride()), dtype=str(arg.dtype),
                                               itemsize=arg.element_size(), offset=arg.storage_offset(),
                                               storage=arg.untyped_storage().nbytes(), ptr=arg.data_ptr()),
                                   type=kind, spec=spec)
        else:
            arguments[name] = dict(value=_value(arg), type=kind, spec=spec)
    return dict(function=function(kernel.fn), grid=grid, options=options, constexprs=constexprs, args=arguments)


@contextlib.contextmanager
def recording() -> Iterator[List[dict]]:
    """Every interpreted Triton launch recorded (``describe``) and run as nothing (``SCALES_KERNEL``'s floating
    tensors set to 1). Needs ``TRITON_INTERPRET=1`` before Triton is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("launches: set TRITON_INTERPRET=1 before Triton is imported")
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    launches: List[dict] = []

    def launcher(kernel, grid):
        def run(*args, **kwargs):
            launches.append(describe(kernel, grid, args, kwargs))
            if kernel.fn.__name__ == SCALES_KERNEL:
                for arg in args:
                    if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                        arg.fill_(1.0)
        return run

    original = InterpretedFunction.__getitem__
    InterpretedFunction.__getitem__ = launcher
    try:
        yield launches
    finally:
        InterpretedFunction.__getitem__ = original


def record(method: str, causal: bool, n: int, batch: int, heads: int = 12, embed: int = 768,
           dtype: str = "float16") -> List[dict]:
    """The launches of one training step of ``method``'s fused module (``embed`` wide, ``heads`` heads) on B =
    ``batch`` sequences of ``n`` tokens in ``dtype``: forward and backward from an output gradient, non-causal steps
    with the last eighth of the last sequence padded (as ``module_step``); the second of two steps (the first
    builds what a module keeps)."""
    import torch

    from fairseq_linattn.modules.build import build_attention

    torch.manual_seed(0)
    module = build_attention(method, embed, heads, causal=causal, config={"attention_impl": "fused"})
    module = module.to(dtype=getattr(torch, dtype)).train()
    x = torch.randn(n, batch, embed, dtype=getattr(torch, dtype), requires_grad=True)
    mask = None
    if not causal:
        mask = torch.zeros(batch, n, dtype=torch.bool)
        mask[-1, n - n // 8:] = True
    with recording() as launches:
        for _ in range(2):
            launches.clear()
            module.zero_grad(set_to_none=True)
            x.grad = None
            out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
            out.backward(x.detach())
    return list(launches)


def specialisation(records: List[dict]) -> Dict[str, List[dict]]:
    """Per kernel function, each distinct (constexprs, specialisation) of its recorded launches: what
    ``kernel_resources`` compiles for."""
    out: Dict[str, List[dict]] = {}
    for launch in records:
        entry = dict(constexprs=launch["constexprs"], spec={k: a["spec"] for k, a in launch["args"].items()})
        if entry not in out.setdefault(launch["function"], []):
            out[launch["function"]].append(entry)
    return out


def _series(text: str) -> tuple:
    method, _, causal = text.partition(":")
    return method, causal == "causal"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--series", nargs="+", type=_series, default=list(SERIES),
                   help="method[:causal] (default: the targets' series and LAVO non-causal)")
    p.add_argument("--n", type=int, nargs="+", default=[2048], help="sequence lengths (default 2048)")
    p.add_argument("--tokens-per-step", type=int, default=32768, help="B = this // N (default 32768)")
    p.add_argument("--d", type=int, nargs="+", default=[64], help="head sizes, 768 / D heads (default 64)")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--root", help="import linattn and fairseq_linattn from this tree (an earlier commit's)")
    p.add_argument("--json", help="write every launch here")
    p.add_argument("--specialisation", help="write each kernel's specialisations here (at --d 64 and 128)")
    args = p.parse_args(argv)
    root = str(Path(args.root).resolve()) if args.root else None
    if root and os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != root:
        # the earlier tree's packages first on the path of a child process that records (no import from here yet)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        child = [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(child, env=env).returncode
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    sizes = [64, 128] if args.specialisation and args.d == [64] else args.d
    runs = []
    for d in sizes:
        for n in args.n:
            for method, causal in args.series:
                launches = record(method, causal, n, max(1, args.tokens_per_step // n), heads=768 // d,
                                  dtype=args.dtype)
                runs.append(dict(method=method, causal=causal, n=n, batch=max(1, args.tokens_per_step // n),
                                 d=d, heads=768 // d, dtype=args.dtype, launches=launches))
                print(f"{method}{' causal' * causal} N={n} D={d}: {len(launches)} launches", flush=True)
    info = dict(triton=triton.__version__, torch=torch.__version__, root=args.root or ".")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(**info, runs=runs), indent=1) + "\n")
    if args.specialisation:
        table = {str(d): specialisation([x for r in runs if r["d"] == d for x in r["launches"]]) for d in sizes}
        Path(args.specialisation).write_text(json.dumps(dict(
            **info, shape=f"B = {args.tokens_per_step} // N, N = {args.n}, E = 768, H = 768 / D, {args.dtype}",
            series=[f"{m}{' causal' * c}" for m, c in args.series], kernels=table), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

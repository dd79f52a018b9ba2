"""The ``compile`` stage: ``--attention-compile`` on the device (Triton kernels on a GPU, C++ here).

For every method in the encoder and decoder roles (``--quick``: causal LLN only), one module training step as
fairseq's trainer runs it (moment folds deferred), compiled and eager from the same weights, inputs and random draws
(Inductor draws through ATen here, so that Skyformer's landmarks agree): in the parallel implementation in float32,
and in the fused one (its Triton kernels as custom ops inside Inductor's graph) in bfloat16 on a GPU with it, else
float16, for the methods with fused kernels (a SKIP naming why where fused cannot run: the CPU without Triton's
interpreter);
- outputs, input and parameter gradients within ``linattn.tolerances``' entry for the dtype;
- one Dynamo graph: a graph break would leave part of the op uncompiled;
- the step's time compiled against eager, after the compilation (INFO: compiling is meant to pay on a GPU).
The cases compile in parallel processes (``compile_jobs``): on an H100 each took about 35 s, one after another.
"""
import copy
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import List

from linattn.tolerances import tolerance

from .core import Row, Settings, Stage
from .ops import SIZES, SMALL, fused_refusal, rel_err

ROLES = ("encoder", "decoder")
QUICK_CASES = (("lln", "decoder", "parallel"), ("lln", "decoder", "fused"))
TIMED_STEPS = 3


def cases(quick: bool, device: str = "cuda"):
    """(method, role, impl) triples the stage checks: every method and role in ``parallel``, and in ``fused`` those
    whose op has fused kernels; ``quick`` on the CPU, causal LLN in ``parallel`` only (Triton's interpreter takes
    minutes at this stage's sizes; ``tests/plugin/test_fused_compile.py`` compiles the fused modules there)."""
    from linattn.methods import METHODS
    from linattn.ops.impls import table_of

    if quick:
        return QUICK_CASES if device.startswith("cuda") else QUICK_CASES[:1]
    pairs = [(name, role) for name, method in METHODS.items() for role in ROLES if role in method.roles]
    fused = [(name, role, "fused") for name, role in pairs if "fused" in (table_of(name) or ())]
    return tuple((name, role, "parallel") for name, role in pairs) + tuple(fused)


def case_dtype(impl: str, device: str) -> str:
    """The dtype a case runs in: float32 for ``parallel``; the fused kernels take half only, bfloat16 where the
    device has it natively (what people train in), else float16."""
    import torch

    if impl != "fused":
        return "float32"
    return "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float16"


def build_pair(method: str, role: str, device: str, check: str = "off", impl: str = "parallel",
               dtype: str = "float32"):
    """(compiled, eager) modules with the same weights, in ``dtype`` on ``device``, running ``impl``; the compiled one
    with ``--attention-compile-check check`` (default off: this stage is that check, and counts the graphs too)."""
    import torch

    from fairseq_linattn.modules import build_attention

    size = SIZES[False]
    compiled = build_attention(method, size["heads"] * size["head_dim"], size["heads"], causal=role == "decoder",
                               config={**SMALL, "attention_impl": impl, "attention_compile": True,
                                       "attention_compile_check": check}).to(device, getattr(torch, dtype))
    eager = copy.deepcopy(compiled)
    eager.config = type(compiled.config)(**{**vars(compiled.config), "attention_compile": False})
    return compiled, eager


def training_step(module, x, mask, seed: int):
    """One training step: (output, input gradient, parameter gradients); the random state reset to ``seed`` first."""
    import torch
    import torch._inductor.config

    from fairseq_linattn.modules.moment_matcher import folds_deferred

    torch.manual_seed(seed)
    xi = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with folds_deferred(), torch._inductor.config.patch(fallback_random=True):
        out, _ = module(xi, xi, xi, key_padding_mask=mask, need_weights=False)
    out.square().mean().backward()
    return out.detach(), xi.grad, [p.grad for p in module.parameters() if p.grad is not None]


def _seconds(fn, device: str) -> float:
    """Mean seconds of ``TIMED_STEPS`` calls (the benchmarks' timer: CUDA events on a GPU)."""
    import torch

    from linattn_tools.benchmark.measure import elapsed_seconds

    return sum(elapsed_seconds(fn, torch.device(device)) for _ in range(TIMED_STEPS)) / TIMED_STEPS


def check_case(stage: Stage, method: str, role: str, device: str, impl: str = "parallel") -> None:
    """The rows of one (method, role, impl): values, graphs, time; a fused case that cannot run here, one SKIP."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fairseq_linattn.modules.compile_check import gradient_errors

    dtype = case_dtype(impl, device)
    name = f"{method} {role}" if impl == "parallel" else f"{method} {role} {impl} {dtype}"
    if impl == "fused":
        why = fused_refusal(method, device, dtype, SIZES[False]["head_dim"])
        if why is not None:
            stage.add(f"{name} compiles", "SKIP", detail=why[:300])
            return
    size = SIZES[False]
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = build_pair(method, role, device, impl=impl, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size["n"], size["batch"], size["heads"] * size["head_dim"], generator=g).to(device,
                                                                                              getattr(torch, dtype))
    mask = torch.zeros(size["batch"], size["n"], dtype=torch.bool)
    mask[-1, size["n"] * 3 // 4:] = True
    mask = mask.to(device)
    try:
        got = training_step(compiled, x, mask, seed=1)
    except Exception as exc:  # no Triton, an Inductor error: this case fails, the others still run
        stage.add(f"{name} compiles", "FAIL", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return
    want = training_step(eager, x, mask, seed=1)
    limit, grad_limit = tolerance(method, dtype), tolerance(method, dtype, gradient=True)
    stage.judge(f"{name} output compiled vs eager", rel_err(got[0], want[0]) <= limit, rel_err(got[0], want[0]),
                f"<= {limit:.1e}")
    errors = gradient_errors([got[1], *got[2]], [want[1], *want[2]])  # zero-in-exact-arithmetic ones: noise
    stage.judge(f"{name} gradients compiled vs eager", len(got[2]) == len(want[2]) and max(errors) <= grad_limit,
                max(errors), f"<= {grad_limit:.1e}", f"{len(errors)} tensors")
    graphs = counters["stats"]["unique_graphs"]
    stage.judge(f"{name} Dynamo graphs", graphs == 1, graphs, "1 (no graph break)",
                "; ".join(f"{k}: {v}" for k, v in counters["graph_break"].items())[:300])
    fast, slow = _seconds(lambda: training_step(compiled, x, mask, seed=1), device), \
        _seconds(lambda: training_step(eager, x, mask, seed=1), device)
    stage.add(f"{name} step time compiled vs eager", "INFO", f"{1e3 * fast:.3g} ms vs {1e3 * slow:.3g} ms "
              f"(x{fast / slow:.2f})", "—", f"N = {size['n']}, B = {size['batch']}, {size['heads']} heads, {impl} "
              f"{dtype}")


def compile_jobs(cases_count: int) -> int:
    """Cases compiled at once: Inductor's compilation is CPU-bound and uses several threads of its own, so a
    quarter of the cores, one process each (the step times, INFO rows, are then taken side by side)."""
    return max(1, min(cases_count, (os.cpu_count() or 1) // 4))


def _case_rows(method: str, role: str, impl: str, device: str) -> List[Row]:
    """The rows of one case, in a process of its own."""
    stage = Stage("compile")
    check_case(stage, method, role, device, impl)
    return stage.rows


def compile_stage(settings: Settings) -> Stage:
    todo = [case for case in cases(settings.quick, settings.device)
            if not settings.methods or case[0] in settings.methods]
    jobs = compile_jobs(len(todo))
    every = f"{', '.join(settings.methods)} (--methods)" if settings.methods else "every method"
    stage = Stage("compile", note=("causal LLN only (--quick)" if settings.quick else f"{every}, encoder and "
                                   "decoder") + ", parallel implementation in float32, fused in half precision"
                  + (f"; {jobs} cases at once" if jobs > 1 else ""))
    if jobs == 1:
        for method, role, impl in todo:
            check_case(stage, method, role, settings.device, impl)
        return stage
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for rows in pool.map(_case_rows, *zip(*todo), [settings.device] * len(todo)):
            stage.rows += rows
    return stage

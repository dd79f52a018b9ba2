"""The ``cuda_graph`` stage: ``--attention-cuda-graph`` on the device (docs/design.md §1.5).

For every method in the encoder and decoder roles (``--quick``: causal LLN only), a capturing module training step
and ``STEPS`` more, as fairseq's trainer runs them (moment folds deferred, then folded as its optimizer step does),
captured and replayed against eager from the same weights, inputs and random state, in the fused implementation
where the method has kernels, else ``parallel``, in bfloat16 where the GPU has it natively, else float16:
- the output, input and parameter gradients of every step after the capturing one (whose warm-up passes draw from
  the random state first) within ``linattn.tolerances``' entry for the dtype (Skyformer's landmarks drawn inside the
  graph: its rows say whether a replay's draws are eager's from the same seed);
- the moment matcher's statistics after the steps equal (the capture's warm-up passes put back);
- one graph captured, and none in eval;
- the step's time replayed against eager (INFO: the host's share of a small step, which the replay removes).
On the CPU the stage is one SKIP: CUDA graphs need CUDA (``tests/plugin/test_cuda_graph.py`` runs the same logic
there with a stand-in for the capture).
"""
import copy

from linattn.tolerances import tolerance

from .compiled import ROLES, _seconds, case_dtype
from .core import Settings, Stage
from .ops import SIZES, SMALL, fused_refusal, rel_err

STEPS = 3
BUFFER_LIMIT = 1e-4  # the matcher's float32/float64 statistics, replayed against eager
QUICK_CASES = (("lln", "decoder"),)


def buffer_error(a, b) -> float:
    """rel_err of two float buffers (the same kernels on the same inputs: only a reduction's order differs); 0 or
    inf for integer ones (the matcher's count of folded batches), which must be equal."""
    if a.is_floating_point():
        return rel_err(a, b)
    return 0.0 if bool((a == b).all()) else float("inf")


def cases(quick: bool):
    """(method, role) pairs the stage checks."""
    from linattn.methods import METHODS

    if quick:
        return QUICK_CASES
    return tuple((name, role) for name, method in METHODS.items() for role in ROLES if role in method.roles)


def training_step(module, x, mask, seed: int):
    """(output, input gradient, parameter gradients) of one step as fairseq's trainer runs it, the random state
    reset to ``seed`` first, the deferred moments folded after the backward."""
    import torch

    from fairseq_linattn.modules.moment_matcher import MomentMatcher, folds_deferred

    torch.manual_seed(seed)
    xi = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with folds_deferred():
        out, _ = module(xi, xi, xi, key_padding_mask=mask, need_weights=False)
    out.float().square().mean().backward()
    for m in module.modules():
        if isinstance(m, MomentMatcher):
            m.fold_pending()
    return out.detach(), xi.grad, [p.grad for p in module.parameters() if p.grad is not None]


def check_case(stage: Stage, method: str, role: str, device: str) -> None:
    import torch

    from fairseq_linattn.modules import build_attention
    from fairseq_linattn.modules.compile_check import gradient_errors

    dtype = case_dtype("fused", device)
    size = SIZES[False]
    impl = "parallel" if fused_refusal(method, device, dtype, size["head_dim"]) else "fused"
    name = f"{method} {role} {impl} {dtype}"
    eager = build_attention(method, size["heads"] * size["head_dim"], size["heads"], causal=role == "decoder",
                            config={**SMALL, "attention_impl": impl}).to(device, getattr(torch, dtype)).train()
    graphed = copy.deepcopy(eager)
    graphed.config = type(eager.config)(**{**vars(eager.config), "attention_cuda_graph": True})
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(size["batch"], size["n"], dtype=torch.bool)
    mask[-1, size["n"] * 3 // 4:] = True
    mask[0, :size["n"] // 8] = True
    mask = mask.to(device)
    limit, grad_limit = tolerance(method, dtype), tolerance(method, dtype, gradient=True)
    worst, worst_grad = 0.0, 0.0
    try:
        for step in range(STEPS + 1):
            x = torch.randn(size["n"], size["batch"], size["heads"] * size["head_dim"], generator=g)
            x = x.to(device, getattr(torch, dtype))
            got, want = training_step(graphed, x, mask, seed=step), training_step(eager, x, mask, seed=step)
            if step == 0:  # the capture: its warm-up passes draw from the random state before the replay
                continue
            worst = max(worst, rel_err(got[0], want[0]))
            errors = gradient_errors([got[1], *got[2]], [want[1], *want[2]])
            worst_grad = max(worst_grad, max(errors) if len(got[2]) == len(want[2]) else float("inf"))
    except Exception as exc:  # a capture CUDA refuses (a host sync, a CPU tensor): this case fails, others run
        stage.add(f"{name} captures", "FAIL", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return
    stage.judge(f"{name} outputs replayed vs eager", worst <= limit, worst, f"<= {limit:.1e}",
                f"{STEPS} steps after the capture's")
    stage.judge(f"{name} gradients replayed vs eager", worst_grad <= grad_limit, worst_grad, f"<= {grad_limit:.1e}")
    drift = max([buffer_error(a, b) for a, b in zip(graphed.buffers(), eager.buffers())], default=0.0)
    stage.judge(f"{name} buffers (moment statistics) replayed vs eager", drift <= BUFFER_LIMIT, drift,
                f"<= {BUFFER_LIMIT:.0e}", "counts exact")
    steps = graphed.__dict__.get("_cuda_graphs")
    captured = len(steps.graphs) if steps is not None else 0
    graphed.eval()
    with torch.no_grad():
        graphed(x, x, x, key_padding_mask=mask, need_weights=False)
    after = len(steps.graphs) if steps is not None else 0
    stage.judge(f"{name} graphs captured", captured == 1 and after == 1, captured, "1, none more in eval")
    graphed.train()
    fast = _seconds(lambda: training_step(graphed, x, mask, seed=0), device)
    slow = _seconds(lambda: training_step(eager, x, mask, seed=0), device)
    stage.add(f"{name} step time replayed vs eager", "INFO", f"{1e3 * fast:.3g} ms vs {1e3 * slow:.3g} ms "
              f"(x{fast / slow:.2f})", "—", f"N = {size['n']}, B = {size['batch']}, {size['heads']} heads")


def cuda_graph_stage(settings: Settings) -> Stage:
    todo = [case for case in cases(settings.quick) if not settings.methods or case[0] in settings.methods]
    stage = Stage("cuda_graph", note="causal LLN only (--quick)" if settings.quick else
                  "every method, encoder and decoder, fused where it has kernels, in half precision")
    if not settings.cuda:
        stage.add("captured steps", "SKIP", detail="CUDA graphs need a CUDA device")
        return stage
    for method, role in todo:
        check_case(stage, method, role, settings.device)
    return stage

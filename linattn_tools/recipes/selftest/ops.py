"""The ``ops`` stage: every method x role x dtype x implementation (``attention_impl`` parallel and looped; fused
in float16 and bfloat16 for the methods whose op has fused kernels, the module cast to that dtype as --fp16 and
--bf16 training casts it, a SKIP row naming the others or why the kernels cannot run here), its module's ``attend``
on the device, forward and input gradients, judged by ``linattn.tolerances`` (the table the CPU tests read):

- eval: against the module's ``reference`` (its op's materialised formula) on a float64 CPU copy, same (rounded)
  inputs; padded batch rows compared on their valid rows;
- train: the training forward (batch statistics, EMA folds, landmark redraws) against the same module in float64 on
  the same device with the device's random draws replayed; the statistics buffers it updated against a float64
  training forward on the CPU;
- draws: a method redraws per training call on the device exactly when it does on the CPU;
- dropout (float32, p = 0.1): over K training calls the output's relative bias from the dropout-free call, in the
  output's direction, is within ``Z_LIMIT`` standard errors of 0: a missing 1 / (1 - p) rescale or a mask shared by
  the draws fails it.
"""
import copy
import math
from typing import Callable, Dict, Iterable, Optional, Tuple

from linattn.tolerances import tolerance

from .core import Settings, Stage

DTYPES = ("float32", "float16", "bfloat16")
IMPLS = ("parallel", "looped", "fused")
FUSED_DTYPES = ("float16", "bfloat16")  # the dtypes the fused kernels take (linattn/ops/lln/fused.py)
# small settings so that blocks, chunks, windows and landmarks all come into play at N = 200 (and N = 40)
SMALL = dict(lln_chunk_size=16, lln_diag_block_size=16, skyformer_landmarks=16, lavo_window=8)
SIZES = {False: dict(batch=2, heads=3, n=200, head_dim=32, draws=256),
         True: dict(batch=2, heads=2, n=40, head_dim=8, draws=32)}
DROPOUT = 0.1
Z_LIMIT = 5.0  # |t| above 5 with 31 degrees of freedom: 2e-5 for an unbiased dropout; a missing rescale gives ~40


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (as tests/helpers.py)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def build_cases(heads: int, head_dim: int, impl: str, dropout: float = 0.0, seed: int = 0) -> Dict[str, object]:
    """{"method role": module} for every method of the registry in every role it declares (float32, on the CPU)."""
    import torch

    from fairseq_linattn.modules import build_attention
    from linattn.methods import METHODS

    torch.manual_seed(seed)
    return {f"{name} {role}": build_attention(name, heads * head_dim, heads, causal=role == "decoder",
                                              cross=role == "cross", dropout=dropout,
                                              config={**SMALL, "attention_impl": impl})
            for name, method in METHODS.items() for role in method.roles}


def _call(module, q, k, v, mask):
    return module.attend(q, k if module.uses_keys else None, v, mask)


def _grads(out, inputs, cot):
    import torch

    return torch.autograd.grad(out, inputs, cot.to(device=out.device, dtype=out.dtype), allow_unused=True)


def _grad_err(got, want) -> Tuple[float, bool]:
    """The largest relative error of the gradients, and whether both sides agree on which are None."""
    same = all((g is None) == (w is None) for g, w in zip(got, want))
    return max((rel_err(g, w) for g, w in zip(got, want) if g is not None and w is not None), default=0.0), same


def _rng(device: str):
    import torch

    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_rng(device: str, state) -> None:
    import torch

    (torch.cuda.set_rng_state if device == "cuda" else torch.set_rng_state)(state)


def _inputs(gen, dtype, batch, heads, n, head_dim):
    import torch

    mask = torch.zeros(batch, n, dtype=torch.bool)
    mask[1:, n - n // 5:] = True  # the other rows padded at the end
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    cot = torch.randn(batch, heads, n, head_dim, generator=gen) * ~mask[:, None, :, None]
    return q, k, v, mask, cot


def _valid(x, mask):
    return x.detach().cpu().transpose(1, 2)[~mask]


def float64_copy(module, twin=None):
    """A float64 copy of ``module``, or of ``twin`` (the same case in an implementation that takes float64: the
    fused kernels take half only) holding ``module``'s state."""
    if twin is None:
        return copy.deepcopy(module).double()
    twin = copy.deepcopy(twin).double()
    twin.load_state_dict(module.state_dict())
    return twin


def eval_row(module, device, dtype_name, inputs, twin=None) -> dict:
    """The device module in eval mode against its reference on a float64 CPU copy (``float64_copy``)."""
    import torch

    q, k, v, mask, cot = inputs
    ref = float64_copy(module, twin).eval()
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    want = ref.reference(*ref_in, mask)
    want_grads = _grads(want, ref_in, cot)
    dev = copy.deepcopy(module).to(device).eval()
    dev_in = [t.to(device).requires_grad_() for t in (q, k, v)]
    got = _call(dev, *dev_in, mask.to(device))
    grad_err, same = _grad_err(_grads(got, dev_in, cot), want_grads)
    return {"out": rel_err(_valid(got, mask), _valid(want, mask)), "grad": grad_err,
            "ok_shape": same and got.dtype == getattr(torch, dtype_name)}


def train_row(module, device, dtype_name, inputs, twin=None) -> dict:
    """The device module in training mode against its float64 copy on the device (``float64_copy``), draws
    replayed; and its floating-point buffers (moment statistics) after the forward against a float64 training
    forward on the CPU."""
    import torch

    q, k, v, mask, cot = inputs
    dev = copy.deepcopy(module).to(device).train()
    dev64 = float64_copy(module, twin).to(device).train()
    cpu64 = float64_copy(module, twin).train()
    state = _rng(device)
    dev_in = [t.to(device).requires_grad_() for t in (q, k, v)]
    got = _call(dev, *dev_in, mask.to(device))
    got_grads = _grads(got, dev_in, cot)
    _set_rng(device, state)
    in64 = [t.double().to(device).requires_grad_() for t in (q, k, v)]
    want = _call(dev64, *in64, mask.to(device))
    grad_err, same = _grad_err(got_grads, _grads(want, in64, cot))
    _call(cpu64, *(t.double() for t in (q, k, v)), mask)  # with grad on: a forward trained on folds statistics
    ref_buffers = dict(cpu64.named_buffers())
    buffers = {name: rel_err(b, ref_buffers[name]) for name, b in dev.named_buffers() if b.is_floating_point()}
    return {"out": rel_err(_valid(got, mask), _valid(want, mask)), "grad": grad_err, "buffers": buffers,
            "ok_shape": same and got.dtype == getattr(torch, dtype_name)}


def redraws(module, device, inputs) -> bool:
    """Two training calls (no grad: no statistics folded) give different outputs."""
    import torch

    q, k, v, mask, _ = inputs
    module = module.to(device).train()
    with torch.no_grad():
        args = [t.to(device) for t in (q, k, v)] + [mask.to(device)]
        return not torch.equal(_call(module, *args), _call(module, *args))


def dropout_row(module, device, inputs, draws: int) -> dict:
    """``draws`` training calls with dropout, each against the same call without it (the RNG replayed, so landmark
    draws cancel): per draw the relative bias b = <y - y0, y0> / <y0, y0> on the valid rows; ``z`` = mean(b) over
    its standard error (Student's t with draws - 1 degrees of freedom when dropout is unbiased; infinite when all
    draws moved the output alike, a mask shared by the draws)."""
    import torch

    q, k, v, mask, _ = inputs
    drop = copy.deepcopy(module).to(device).train()
    plain = copy.deepcopy(drop)
    plain.dropout = 0.0
    args = [t.to(device) for t in (q, k, v)] + [mask.to(device)]
    biases, acts = [], False
    with torch.no_grad():
        for _ in range(draws):
            before = _rng(device)
            y = _valid(_call(drop, *args), mask).double()
            after = _rng(device)
            _set_rng(device, before)
            y0 = _valid(_call(plain, *args), mask).double()
            _set_rng(device, after)
            acts = acts or not torch.equal(y, y0)
            biases.append(float(((y - y0) * y0).sum() / (y0 * y0).sum().clamp_min(1e-300)))
    b = torch.tensor(biases, dtype=torch.float64)
    mean, se = float(b.mean()), float(b.std() / math.sqrt(draws))
    z = mean / se if se > 0 else 0.0 if mean == 0 else math.inf
    return {"bias": mean, "z": z, "acts": acts, "finite": bool(torch.isfinite(b).all())}


def _judge_pair(stage: Stage, check: str, row: dict, tol: float, grad_tol: float) -> None:
    ok = row["ok_shape"] and row["out"] <= tol and row["grad"] <= grad_tol
    stage.judge(check, ok, f"out {row['out']:.2e}, grad {row['grad']:.2e}",
                f"out <= {tol:.0e}, grad <= {grad_tol:.0e}",
                "" if row["ok_shape"] else "wrong output dtype or gradient set")


def check_case(stage: Stage, name: str, module, settings: Settings, dtypes: Iterable[str], impl: str,
               sizes: dict, seed: int = 0, dropout_module: Optional[object] = None, twin: Optional[object] = None
               ) -> None:
    """All rows of one case in one implementation; a crash fails that row, the others still run. With ``twin`` (the
    case in an implementation that takes float64), the module is cast to each row's dtype and its float64 copies
    are the twin's (``float64_copy``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the training draws (landmarks, dropout masks)
    for dtype_name in dtypes:
        inputs = _inputs(gen, getattr(torch, dtype_name), sizes["batch"], sizes["heads"], sizes["n"],
                         sizes["head_dim"])
        if dtype_name == "bfloat16" and not settings.bf16:
            for mode in ("eval", "train"):
                stage.add(f"{name} {impl} {mode} {dtype_name}", "SKIP", detail="no native bfloat16 on this GPU")
            continue
        tol, grad_tol = tolerance(module.method, dtype_name), tolerance(module.method, dtype_name, gradient=True)
        case = module if twin is None else copy.deepcopy(module).to(getattr(torch, dtype_name))
        for mode, fn in (("eval", eval_row), ("train", train_row)):
            check = f"{name} {impl} {mode} {dtype_name}"
            try:
                row = fn(case, settings.device, dtype_name, inputs, twin)
            except Exception as exc:  # a crash is a failure of that case, not of the self-test
                stage.add(check, "FAIL", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
                continue
            _judge_pair(stage, check, row, tol, grad_tol)
            if row.get("buffers"):
                worst = max(row["buffers"], key=row["buffers"].get)
                stage.judge(f"{check} statistics", row["buffers"][worst] <= tol, row["buffers"][worst],
                            f"<= {tol:.0e}", f"worst buffer {worst} of {', '.join(sorted(row['buffers']))}")
        if dtype_name != "float32":
            continue
        try:
            on_device = redraws(copy.deepcopy(module), settings.device, inputs)
            on_cpu = redraws(copy.deepcopy(module).double(), "cpu", [t.double() if t.is_floating_point() else t
                                                                       for t in inputs])
            stage.judge(f"{name} {impl} train draws", on_device == on_cpu,
                        f"redrawn per call: device {'yes' if on_device else 'no'}",
                        f"as on the CPU ({'yes' if on_cpu else 'no'})")
            if dropout_module is not None:
                res = dropout_row(dropout_module, settings.device, inputs, sizes["draws"])
                stage.judge(f"{name} {impl} train dropout {DROPOUT}", res["finite"] and abs(res["z"]) <= Z_LIMIT,
                            f"bias {res['bias']:+.1e}, z {res['z']:+.1f}",
                            f"|z| <= {Z_LIMIT:g} over {sizes['draws']} draws (unbiased)",
                            f"dropout {'acts' if res['acts'] else 'does not act'} on this method's output")
        except Exception as exc:
            stage.add(f"{name} {impl} train draws/dropout", "FAIL",
                      detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])


def ops_stage(settings: Settings, only: Optional[Callable[[str], bool]] = None) -> Stage:
    """Every case in every impl and dtype on ``settings.device`` (``only``: a filter on the case names)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    stage = Stage("ops", note="tolerances: linattn/tolerances.py (relative error; gradients x2)")
    sizes = SIZES[settings.quick]
    twins = build_cases(sizes["heads"], sizes["head_dim"], "parallel")  # the same parameters: the same seed
    for impl in IMPLS:
        cases = build_cases(sizes["heads"], sizes["head_dim"], impl)
        dropped = build_cases(sizes["heads"], sizes["head_dim"], impl, dropout=DROPOUT)
        for name, module in cases.items():
            if (only is not None and not only(name)) or (settings.methods and module.method not in settings.methods):
                continue
            if impl != "fused":
                check_case(stage, name, module, settings, DTYPES, impl, sizes, dropout_module=dropped[name])
                continue
            why = fused_refusal(module.method, settings.device, "float16", sizes["head_dim"])
            if why is None:
                check_case(stage, name, module, settings, FUSED_DTYPES, impl, sizes, twin=twins[name])
            else:
                stage.add(f"{name} fused", "SKIP", detail=why)
    return stage


def fused_refusal(method: str, device: str, dtype: str, head_dim: int) -> Optional[str]:
    """Why ``fused`` does not run ``method``'s op on ``device`` in ``dtype`` at ``head_dim`` (``impls``' reasons: no
    Triton, the CPU without Triton's interpreter; or the implementation it runs instead), or None where it does."""
    import torch

    from linattn.ops.impls import ImplementationError, implementation_for

    probe = torch.empty(1, 1, 1, head_dim, dtype=getattr(torch, dtype), device=device)
    try:
        ran = implementation_for(method, "fused", probe)
    except ImplementationError as err:
        return "; ".join(err.reasons)
    return None if ran == "fused" else f"{ran} runs: no fused kernel for this op"

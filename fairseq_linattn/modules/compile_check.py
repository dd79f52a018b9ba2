"""``--attention-compile`` and its net (docs/design.md §1.4): the torch versions it accepts, and the first compiled
training step of each module checked against eager on the user's own machine.

torch 2.11 gave wrong compiled gradients (pytorch#180642; the ops now return fresh outputs while compiling,
``linattn.ops.precision.function_output``): a compiler bug of a later torch could do the same, silently. So the first
training step of each compiled module also runs its attention eagerly, from the same inputs, state and random
draws, and stops training if the output or a gradient differs by more than the tolerance table allows.
"""
import logging
import time
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from linattn.compile_shapes import compile_varying_lengths
from linattn.tolerances import tolerance

logger = logging.getLogger(__name__)

OLDEST_TORCH = (2, 11)  # the oldest torch the compile tests have run on (2.11 in the slow tier, and CI's torch)
CHECK_OPTION = "--attention-compile-check off"


def torch_version(version: str) -> tuple:
    """'2.11.0+cu130' -> (2, 11)."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def check_torch_for_compile(version: Optional[str] = None) -> None:
    """Refuse ``--attention-compile`` on a torch (default: the installed one) older than the oldest verified one:
    one line, the reason."""
    version = version or torch.__version__
    if torch_version(version) < OLDEST_TORCH:
        raise ValueError(f"--attention-compile needs torch >= {'.'.join(map(str, OLDEST_TORCH))} (its compiled "
                         f"gradients are verified from there; torch {version} is older): upgrade torch or train "
                         f"without --attention-compile")


def compile_attend(module) -> Callable:
    """``module.attend`` under ``torch.compile``, its batch size and lengths symbolic (``compile_varying_lengths``);
    random numbers drawn as eager draws them (Inductor's own generator would give Skyformer's landmarks and dropout
    other draws than eager's)."""
    return compile_varying_lengths(module.attend, options={"fallback_random": True})


def _rel_err(got: Tensor, want: Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))  # sync ok: once per module and run


def _step(attend: Callable, inputs: Sequence[Optional[Tensor]], params: List[Tensor], extra, cotangent: Tensor):
    """The output and the gradients of (the inputs that are tensors, params) for ``cotangent``."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
    out = attend(*leaves, *extra)
    wrt = [t for t in leaves if t is not None] + params
    return out.detach(), torch.autograd.grad(out, wrt, cotangent, allow_unused=True)


def _set_rng(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(*state[1])


def check_first_step(module, compiled: Callable, q: Tensor, k: Optional[Tensor], v: Tensor, *extra) -> Tensor:
    """``compiled(q, k, v, *extra)``, after checking it once against ``module.attend`` on detached copies of the
    inputs: output and every input and parameter gradient within the tolerance table's row for the input dtype
    (q, k, v (B,H,N,D); one fixed random cotangent (B,H,N,Dv)). The module's buffers (moment statistics) and the
    random state are put back after each run, so the step itself runs as it would without the check. Raises
    RuntimeError naming the method, the torch version and the error."""
    start = time.perf_counter()
    params = [p for p in module.parameters() if p.requires_grad]
    names = [n for n, t in zip("qkv", (q, k, v)) if t is not None]
    names += [n for n, p in module.named_parameters() if p.requires_grad]
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state(q.device), q.device) if q.device.type == "cuda" else None
    cotangent = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(0)).to(v)
    results = []
    for attend in (compiled, module.attend):
        results.append(_step(attend, (q, k, v), params, extra, cotangent))
        _set_rng(rng)
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
    _judge(module.method, q.dtype, names, *results)
    logger.info("--attention-compile: %s attention's first compiled training step matches eager (checked in %.1f s)",
                module.method, time.perf_counter() - start)
    return compiled(q, k, v, *extra)


NOISE_FLOOR = 1e-3  # of the largest gradient's norm: below it a gradient is rounding noise


def gradient_errors(got: Sequence[Optional[Tensor]], want: Sequence[Optional[Tensor]]) -> List[float]:
    """Each gradient's distance from ``want``'s, relative to its own norm floored at ``NOISE_FLOOR`` of the largest
    one's: a gradient that is zero in exact arithmetic (a key projection's bias under a softmax, which no shift of
    the scores changes) is rounding noise, whose relative error means nothing. A missing one: inf; both None: 0."""
    scale = max((float(w.double().norm()) for w in want if w is not None), default=0.0)  # sync ok: once per run
    errors = []
    for a, b in zip(got, want):
        if b is None or a is None:
            errors.append(0.0 if a is b else float("inf"))
            continue
        a, b = a.double(), b.double()
        errors.append(float((a - b).norm() / max(float(b.norm()), NOISE_FLOOR * scale, 1e-300)))  # sync ok
    return errors


def _judge(method: str, dtype: torch.dtype, names: List[str], compiled, eager) -> None:
    """Raise if the compiled output or a gradient is farther from eager's than the tolerance table allows."""
    name = str(dtype).replace("torch.", "")
    (out_c, grads_c), (out_e, grads_e) = compiled, eager
    checks = [("output", _rel_err(out_c, out_e), tolerance(method, name))]
    limit = tolerance(method, name, gradient=True)
    checks += [(f"gradient of {n}", err, limit) for n, err in zip(names, gradient_errors(grads_c, grads_e))]
    for what, err, limit in checks:
        if not err <= limit:
            raise RuntimeError(
                f"--attention-compile: compiled {method} attention differs from eager on its first training step "
                f"with torch {torch.__version__} ({what}: relative error {err:.2e} > {limit:.1e}); train without "
                f"--attention-compile (or turn this check off with {CHECK_OPTION})")

"""One attention module's training step, as the targets benchmark (``targets``) times it and the developer tools
(``dev/perf``: op counts, traffic, the profiler's table) measure it: ``build_attention(method, 768, 12)`` in a dtype
and ``attention_impl``, inputs of B sequences with the last one's last eighth padded, forward + backward from an
output gradient (docs/benchmarks.md, "GPU shape")."""
import argparse

import torch

from fairseq_linattn.modules.build import build_attention


def module_step_inputs(n: int, dtype=torch.float32, device="cpu", embed_dim: int = 768, batch: int = 2):
    """x (N, B, C) requiring grad and a (B, N) padding mask: the last sequence's last eighth padded."""
    x = torch.randn(n, batch, embed_dim, dtype=dtype, device=device, requires_grad=True)
    mask = torch.zeros(batch, n, dtype=torch.bool, device=device)
    mask[-1, n - n // 8:] = True
    return x, mask


def build(method: str, causal: bool, impl: str, dtype=torch.float32, device="cpu", **options):
    config = {"attention_impl": impl, **options}
    return build_attention(method, 768, 12, causal=causal, config=config).to(device=device, dtype=dtype).train()


def add_step_arguments(p: argparse.ArgumentParser, impl: str) -> None:
    """The options that name one module training step: --method, --causal, --n, --tokens-per-step, --dtype,
    --impl (default ``impl``)."""
    from linattn.methods import METHODS
    from linattn.ops.impls import IMPLS

    p.add_argument("--method", choices=sorted(METHODS), default="lln")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--tokens-per-step", type=int, default=32768, help="B = this // N (at least 1)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    p.add_argument("--impl", choices=IMPLS, default=impl)


def step(module, x, mask) -> None:
    """One training step of the module as a layer of a fairseq model runs it: its gradients and x's set to None (as
    fairseq's ``zero_grad`` does), forward, and backward from an output gradient. x's values stand in for that
    gradient, which the next layer sends in a model: the output's shape, dtype and scale, with no loss computed
    here (a loss would add its own ops, the same to every method, to every step timed)."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
    out.backward(x.detach())

"""Every method with a fused implementation runs it from its fairseq module (``--attention-impl fused``, a half
module as --fp16/--bf16 build it; Triton's interpreter on CPU tensors): the output and the input and parameter
gradients of an eval step stay within the tolerance table of the float64 module, and a training step is finite."""
import copy

import pytest
import torch
from helpers import rel_err

from fairseq_linattn.modules.build import build_attention
from linattn.methods import methods_for
from linattn.ops.impls import implementation_for
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (ops/triton/common.py)

CAUSAL = {"encoder": False, "decoder": True}
FUSED = {"lln": ("lln_noncausal", "lln_causal"), "lln_diag": ("block_softmax",), "skyformer": ("nystrom_apply",),
         "lavo": ("lavo",)}  # a custom op each method's module must run
CASES = [(m, role) for role in CAUSAL for m in methods_for(role) if m in FUSED]
SMALL = dict(lln_chunk_size=8, lln_diag_block_size=8, skyformer_landmarks=8, lavo_window=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method,role", CASES)
def test_fused_module_step_is_close_to_float64(gen, method, role, dtype):
    torch.manual_seed(0)
    exact = build_attention(method, 32, 2, causal=CAUSAL[role], config=dict(SMALL, attention_impl="parallel"))
    exact = exact.double().eval()  # eval: Skyformer's fixed landmarks, the matcher's running statistics
    half = build_attention(method, 32, 2, causal=CAUSAL[role], config=dict(SMALL, attention_impl="fused"))
    half.load_state_dict(copy.deepcopy(exact.state_dict()))
    half = half.to(dtype).eval()
    assert implementation_for(method, "fused", torch.empty(1, 2, 19, 16, dtype=dtype)) == "fused"
    x = torch.randn(19, 2, 32, generator=gen, dtype=torch.float64)
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, :6] = True  # left padding: the second sequence's first 6 tokens
    grad = torch.randn(19, 2, 32, generator=gen, dtype=torch.float64).masked_fill(mask.t()[..., None], 0.0)
    results = []
    for module, xx in ((exact, x), (half, x.to(dtype))):
        xx = xx.clone().requires_grad_()
        with count_dispatch() as counts:
            out, _ = module(xx, xx, xx, key_padding_mask=mask, need_weights=False)
            out.backward(grad.to(out.dtype))
        assert any(op in counts.ops for op in FUSED[method]) == (module is half)
        results.append([out, xx.grad, *(p.grad for p in module.parameters() if p.grad is not None)])
    real = ~mask.t()[..., None]
    want, got = results
    assert got[0].dtype == dtype and rel_err(got[0].masked_fill(~real, 0), want[0].masked_fill(~real, 0)) <= tolerance(
        method, str(dtype).split(".")[1])
    assert len(got) == len(want)
    # relative to the largest gradient: some are 0 in exact arithmetic (a key bias under a softmax over the keys)
    scale = max(w.norm() for w in want[1:])
    for g, w in zip(got[1:], want[1:]):
        assert (g.double() - w).norm() <= tolerance(method, str(dtype).split(".")[1], gradient=True) * max(
            w.norm(), 0.01 * scale)
    half.train()
    out, _ = half(x.to(dtype), x.to(dtype), x.to(dtype), key_padding_mask=mask, need_weights=False)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in half.parameters()
                                             if p.grad is not None)

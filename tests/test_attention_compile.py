"""--attention-compile: a module whose op call runs under torch.compile gives the eager module's outputs and
gradients, in one graph (slow: each compile takes 5-20 s on this CPU)."""
import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fairseq_linattn.modules.build import build_attention
from fairseq_linattn.modules.moment_matcher import folds_deferred

SMALL = dict(lln_chunk_size=16, lln_diag_block_size=16, skyformer_landmarks=16, lavo_window=8)


@pytest.mark.slow
@pytest.mark.parametrize("method,causal", [("lln", True), ("lln", False), ("lln_diag", True), ("lavo", True),
                                           ("skyformer", False), ("kernelized", False)])
def test_compiled_module_step_equals_eager(gen, method, causal):
    """A training step as fairseq's trainer runs it (moment folds deferred): no graph break (the matcher's
    switches and Skyformer's landmark draw once broke it), the eager step's values (Inductor draws Skyformer's
    random landmarks through ATen here, so that both steps draw the same)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = build_attention(method, 32, 4, causal=causal,
                               config=dict(SMALL, attention_impl="parallel", attention_compile=True))
    eager = copy.deepcopy(compiled)
    eager.config = type(compiled.config)(**{**vars(compiled.config), "attention_compile": False})
    x = torch.randn(45, 2, 32, generator=gen)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[1, 30:] = True
    results = []
    for module in (compiled, eager):
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)
        with folds_deferred(), torch._inductor.config.patch(fallback_random=True):
            out, _ = module(xi, xi, xi, key_padding_mask=mask, need_weights=False)
        out.square().mean().backward()
        results.append((out.detach(), xi.grad, [p.grad for p in module.parameters()]))
    (out_c, gx_c, gp_c), (out_e, gx_e, gp_e) = results
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx_c, gx_e, rtol=1e-4, atol=1e-5)
    for a, b in zip(gp_c, gp_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert "_compiled_attend" in compiled.__dict__ and "_compiled_attend" not in eager.__dict__
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])

"""The host-time benchmark (``dev.perf.host_time``): every series measured with its kernels' launches
stubbed, and the stub gone afterwards."""
import pytest
import torch

from dev.perf import host_time
from linattn import ops

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)


def test_every_series_is_timed_with_its_launches_stubbed_and_counted():
    rows = host_time.measure("fused", rounds=1, steps=2)
    assert [(r["method"], r["causal"]) for r in rows] == host_time.series()
    for r in rows:
        linear = r["method"] != host_time.BASELINE
        assert r["impl"] == ("fused" if linear else "only") and r["host_s"] > 0 and r["ops"] > 0
        assert (r["triton_launches"] > 0) == linear, r


def test_the_kernels_run_again_after_the_stub(gen):
    """A stub left in place would make every later fused op return unwritten memory."""
    q, k = (torch.randn(1, 2, 5, 8, generator=gen).half() for _ in range(2))
    with host_time.stub_launches() as counts:
        ops.token_moments(q, k, impl="fused")
    assert counts["launches"] == 1
    rows = ops.token_moments(q, k, impl="fused")
    torch.testing.assert_close(rows[0].double(), q.double().sum(-1), rtol=1e-6, atol=1e-5)
    assert counts["launches"] == 1


# dispatched ops (ATen's and the custom ops) of a fused step: 25, 25, 31, 27 before the scale check was folded into
# the fused op's per-head stack (2e5fa1d); 23, 23, 29, 25 before the matcher's fold joined its scales' launch
STEP_OPS = {("lln", False): 22, ("lln", True): 22, ("lln_diag", False): 28, ("lln_diag", True): 24}


# the same with other options: every moment-matching mode in the matcher's one launch (54 and 117 ops before, off
# causal and exact non-causal); the learnable mixes' two ops and their mixing (72 before, gathering rows non-causal)
OPTION_STEP_OPS = {("lln", False, "exact"): 22, ("lln", True, "off"): 22, ("lln_diag", False, "learnable_ratio"): 44,
                   ("lln_diag", True, "learnable_scale"): 37}
OPTIONS = {"exact": dict(lln_moment_matching="exact"), "off": dict(lln_alpha=2.0, lln_beta=1.5),
           "learnable_ratio": dict(lln_diag_mix="learnable_ratio"),
           "learnable_scale": dict(lln_diag_mix="learnable_scale")}


@pytest.mark.parametrize("method, causal, option", [(m, c, None) for m, c in STEP_OPS] + list(OPTION_STEP_OPS))
def test_a_fused_lln_step_keeps_its_op_budget_and_works_its_implementation_out_once(monkeypatch, method, causal,
                                                                                    option):
    """The host-time proxy without timing: a fused LLN (or LLN+Diag) training step as ``host_time`` runs it
    dispatches at most its budget of ops, syncs the host nowhere, and after its first step asks the kernels' limits
    (``not_supported_reasons``) nothing again: ``implementation_for``'s decisions are kept; with the default options
    and with others that ran more ops."""
    from fairseq_linattn.modules.build import build_attention
    from linattn.ops.lln import fused as lln_fused
    from linattn_tools.benchmark.dispatch import count_dispatch

    run = host_time.Series(method, causal, "fused")
    if option is not None:
        config = {"attention_impl": "fused", **OPTIONS[option]}
        run.module = build_attention(method, host_time.EMBED, host_time.HEADS, causal=causal, config=config)
        run.module = run.module.to(dtype=torch.bfloat16).train()
    asked = []
    original = lln_fused.not_supported_reasons
    with host_time.stub_launches():
        run.step()
        monkeypatch.setattr(lln_fused, "not_supported_reasons", lambda *a, **kw: asked.append(a) or original(*a, **kw))
        with count_dispatch() as counts:
            run.step()
    budget = STEP_OPS[method, causal] if option is None else OPTION_STEP_OPS[method, causal, option]
    assert counts.launched <= budget, counts.ops
    assert counts.host_syncs == 0 and asked == []

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
STEP_OPS = {("lln", False): 22, ("lln", True): 22, ("lln_diag", False): 28, ("lln_diag", True): 24,
            ("skyformer", False): 60, ("lavo", False): 26, ("lavo", True): 19}


# the same with the options that choose another code path: every moment-matching mode in the matcher's one launch
# (70/54 ops before for off, 117/101 for exact); the learnable mixes' two ops and their mixing (72/69 before,
# gathering rows non-causal); the others at their defaults' count or under it
OPTION_STEP_OPS = {("lln", False, "exact"): 22, ("lln", True, "exact"): 22, ("lln", False, "off"): 22,
                   ("lln", True, "off"): 22, ("lln", False, "per_head"): 22, ("lln", True, "batch"): 22,
                   ("lln", False, "ema"): 22, ("lln_diag", True, "per_head"): 24,
                   ("lln_diag", False, "learnable_scale"): 41, ("lln_diag", False, "learnable_ratio"): 44,
                   ("lln_diag", True, "learnable_scale"): 37, ("lln_diag", True, "learnable_ratio"): 40,
                   ("skyformer", False, "uniform"): 53, ("lavo", False, "frozen"): 26, ("lavo", True, "fewer"): 19}
OPTIONS = {"exact": dict(lln_moment_matching="exact"), "off": dict(lln_alpha=2.0, lln_beta=1.5),
           "per_head": dict(lln_stats_per_head=True), "batch": dict(lln_stats="batch"), "ema": dict(lln_stats="ema"),
           "learnable_ratio": dict(lln_diag_mix="learnable_ratio"),
           "learnable_scale": dict(lln_diag_mix="learnable_scale"), "uniform": dict(skyformer_landmark_mode="uniform"),
           "frozen": dict(lavo_freeze_bases=True), "fewer": dict(lavo_bases=8)}


@pytest.mark.parametrize("method, causal, option", [(m, c, None) for m, c in STEP_OPS] + list(OPTION_STEP_OPS))
def test_a_fused_step_keeps_its_op_budget_and_works_its_implementation_out_once(monkeypatch, method, causal,
                                                                                option):
    """The host-time proxy without timing: a fused training step as ``host_time`` runs it dispatches at most its
    budget of ops, syncs the host nowhere, and after its first step asks LLN's kernels' limits
    (``not_supported_reasons``) nothing again: ``implementation_for``'s decisions are kept; with the default options
    and with each that chooses another code path (an option that left the kernels for ATen ops shows)."""
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


# dispatched ops of a graphed step (``--attention-cuda-graph``) after its capture: the copies into the graphs'
# inputs (x, the mask of the non-causal steps, the output's gradient) and the parameters' gradients copied out of
# the graph's (``cuda_graph._copied``: 8 projection weights and biases, more for LLN+Diag's mixes, LAVO's bases)
GRAPHED_STEP_OPS = {False: 11, True: 10}


@pytest.mark.parametrize("method, causal", list(STEP_OPS))
def test_a_graphed_step_leaves_the_host_the_copies_around_its_replays(method, causal):
    """With ``--attention-cuda-graph`` and replays that run nothing (``stub_replays``), a step after its capture
    dispatches only the copies around the replays, whatever the method's own ops, syncs the host nowhere, and
    runs none of the method's kernels."""
    from linattn_tools.benchmark.dispatch import count_dispatch

    run = host_time.Series(method, causal, "fused", graphed=True)
    with host_time.stub_launches() as launches, host_time.stub_replays(True):
        run.step()
        launches["launches"] = 0
        with count_dispatch() as counts:
            run.step()
    assert counts.launched <= GRAPHED_STEP_OPS[causal] + sum(1 for p in run.module.parameters()) - 8, counts.ops
    assert counts.host_syncs == 0 and launches["launches"] == 0
    assert len(run.module.__dict__["_cuda_graphs"].graphs) == 1

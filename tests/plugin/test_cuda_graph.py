"""``--attention-cuda-graph`` (``fairseq_linattn.modules.cuda_graph``) on the CPU: the capture replaced by
``dev.perf.graph_standin``, which keeps ``make_graphed_callables``' warm-up passes and static tensors (inputs copied
in, outputs and gradients overwritten by the next replay) and replays the step eagerly. What it shows: a graphed
module trains as the eager one does, step for step, buffers included; the steps a graph cannot hold run eagerly;
the option is refused where it cannot run. That CUDA captures the steps is the GPU self-test's ``cuda_graph`` stage."""
import copy
import logging

import pytest
import torch

from dev.perf import graph_standin
from fairseq_linattn.modules import cuda_graph
from fairseq_linattn.modules.build import build_attention
from fairseq_linattn.modules.moment_matcher import MomentMatcher, folds_deferred, statistics_left_out
from fairseq_linattn.options import AttentionOptionError, check_attention_options
from linattn.methods import methods_for
from tests.helpers import padding_mask

CAUSAL = {"encoder": False, "decoder": True}
CASES = [(m, role) for role in CAUSAL for m in methods_for(role)]
SMALL = dict(lln_chunk_size=4, lln_diag_block_size=4, skyformer_landmarks=4, lavo_window=4)
DRAWS = {"skyformer"}  # landmarks drawn at every training step: the capture's warm-up draws too
E, H = 16, 2


@pytest.fixture
def standin(monkeypatch):
    """The capture replaced by the CPU stand-in; the captures made, counted."""
    made = []

    def capture(step, args):
        made.append(args)
        return graph_standin.capture(step, args)
    monkeypatch.setattr(cuda_graph, "capture", capture)
    return made


def pair(method: str, role: str, **options):
    """(eager, graphed) float64 modules with the same weights."""
    config = {**SMALL, "attention_impl": "parallel", **options}
    eager = build_attention(method, E, H, causal=CAUSAL[role], config=config).double().train()
    graphed = build_attention(method, E, H, causal=CAUSAL[role], config={**config, "attention_cuda_graph": True})
    graphed.double().train().load_state_dict(eager.state_dict())
    return eager, graphed


def step(module, x, mask, seed: int):
    """Output, x's gradient, the parameters' gradients by name and the buffers after one training step."""
    torch.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out, _ = module(xi, xi, xi, key_padding_mask=mask, need_weights=False)
    out.backward(torch.cos(out.detach() * 3))
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach().clone(), xi.grad, grads, [b.clone() for b in module.buffers()]


def assert_same(got, want, outputs: bool = True):
    if outputs:
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-12, atol=1e-12, msg=name)
    assert len(got[3]) == len(want[3])
    for a, b in zip(got[3], want[3]):
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("method,role", CASES)
def test_a_graphed_module_trains_as_the_eager_one_step_for_step(gen, standin, method, role):
    """Steps at one shape (padding left, then right, then none: a graph each mask's presence), then another shape:
    outputs, input and parameter gradients and buffers (the matcher's running statistics and its count of batches,
    which the capture's warm-up passes would have moved) equal eager's, one capture a shape."""
    eager, graphed = pair(method, role)
    shapes = [(9, 3, "left"), (9, 3, "right"), (9, 3, None), (9, 3, "left"), (6, 2, "right")]
    for seed, (n, b, side) in enumerate(shapes):
        x = torch.randn(n, b, E, generator=gen, dtype=torch.float64)
        mask = None if side is None else padding_mask(b, n, side, gen)
        got, want = step(graphed, x, mask, seed), step(eager, x, mask, seed)
        first = seed in (0, 2, 4)  # a capture: its warm-up draws from the random state before the replay
        assert_same(got, want, outputs=not (first and method in DRAWS))
    assert len(standin) == 3 and len(graphed.__dict__["_cuda_graphs"].graphs) == 3


def test_the_matchers_switches_are_keys_and_their_steps_match_eager(gen, standin):
    """Inside ``statistics_left_out`` (fairseq's dummy batches) and ``folds_deferred`` (its trainer), which the
    matcher reads on the host: a graph each, the same statistics as eager's (none added, or pending until folded)."""
    eager, graphed = pair("lln", "encoder")
    x, mask = torch.randn(7, 2, E, generator=gen, dtype=torch.float64), padding_mask(2, 7, "left", gen)
    for context in (folds_deferred, statistics_left_out, folds_deferred):
        with context():
            got, want = step(graphed, x, mask, 0), step(eager, x, mask, 0)
        assert_same(got, want)
    for module in (eager, graphed):
        module.matcher.fold_pending()
    assert_same(step(graphed, x, mask, 1), step(eager, x, mask, 1))
    assert len(standin) == 3
    assert int(graphed.matcher.running_batches) == 2  # two folds: the left-out batch and the capture's passes add none


def test_a_second_forward_before_the_backward_runs_eagerly_and_train_forgets_it(gen, standin):
    """Two forwards, then their backwards (R-Drop's pattern): the second runs eagerly, so the first's backward reads
    its own activations, and both gradients are eager's; a forward whose backward never came (an update attempt
    fairseq skipped) holds the next step eager only until ``model.train()``."""
    eager, graphed = pair("lln", "decoder")
    xs = [torch.randn(8, 2, E, generator=gen, dtype=torch.float64) for _ in range(2)]
    results = []
    for module in (eager, graphed):
        module.zero_grad(set_to_none=True)
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = [module(x, x, x, need_weights=False)[0] for x in leaves]
        sum(out.square().sum() for out in outs).backward()
        results.append([*outs, *(x.grad for x in leaves), *(p.grad for p in module.parameters())])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(standin) == 1
    steps = graphed.__dict__["_cuda_graphs"]
    graphed(xs[0], xs[0], xs[0], need_weights=False)  # no backward
    assert steps.eager_reason(xs[0]).startswith("a second forward")
    graphed.train()
    assert steps.eager_reason(xs[0]) is None


def test_steps_a_graph_cannot_hold_run_eagerly_and_say_why_once(gen, standin, caplog):
    """Eval, no gradients, weights asked for: eager and no capture. Autocast with its cache (--amp): eager, said
    once. Beyond ``MAX_SHAPES`` shapes: eager, said once. Moving the module (``.to``, ``.half``) drops its graphs,
    which read the tensors they were captured with."""
    eager, graphed = (m.float() for m in pair("lln", "encoder"))  # float32: what CPU autocast casts from
    x = torch.randn(5, 2, E, generator=gen)
    graphed.eval()
    eager.eval()
    torch.testing.assert_close(graphed(x, x, x)[0], eager(x, x, x)[0])
    graphed.train()
    with torch.no_grad():
        graphed(x, x, x, need_weights=False)
    graphed(x, x, x, need_weights=True)
    assert standin == []
    with caplog.at_level(logging.INFO, logger=cuda_graph.__name__):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                graphed(x, x, x, need_weights=False)
        assert standin == []
        for n in range(3, 4 + cuda_graph.MAX_SHAPES):
            xn = torch.randn(n, 2, E, generator=gen)
            graphed(xn, xn, xn, need_weights=False)[0].sum().backward()
    said = [r.getMessage() for r in caplog.records]
    assert len(standin) == cuda_graph.MAX_SHAPES
    assert sum("autocast" in m for m in said) == 1 and sum("shapes captured already" in m for m in said) == 1
    graphed.double()
    assert "_cuda_graphs" not in graphed.__dict__


def test_on_the_cpu_the_capture_is_refused_naming_the_option(gen):
    _, graphed = pair("lln", "encoder")
    x = torch.randn(5, 2, E, generator=gen, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="--attention-cuda-graph needs CUDA"):
        graphed(x, x, x, need_weights=False)


@pytest.mark.parametrize("options,error", [
    (dict(attention_cuda_graph=True, attention_compile=True), "--attention-cuda-graph and --attention-compile"),
    (dict(attention_cuda_graph=True, cpu=True), "needs CUDA; this run is on the CPU \\(--cpu\\)"),
    (dict(attention_cuda_graph=True, amp=True), "cannot capture --amp"),
])
def test_the_option_is_refused_where_the_run_cannot_capture(monkeypatch, options, error):
    """At argument-parsing time, naming the option: with --attention-compile, on the CPU, under --amp."""
    from argparse import Namespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, but for --cpu
    args = Namespace(**{"fp16": not options.get("amp"), "bf16": False, "amp": False, "cpu": False,
                        "encoder_embed_dim": 16, "encoder_attention_heads": 2, "encoder_attention_type": "lln",
                        **options})
    with pytest.raises(AttentionOptionError, match=error):
        check_attention_options(args, encoder_layers=2)
    check_attention_options(Namespace(**{**vars(args), "attention_cuda_graph": False, "attention_compile": False}),
                            encoder_layers=2)


def test_every_method_s_graphed_step_sees_its_matchers():
    """The distributed refusal reads whether a module matches moments (LLN and LLN+Diag hold a matcher)."""
    for method, role in CASES:
        _, graphed = pair(method, role)
        has = any(isinstance(m, MomentMatcher) for m in graphed.modules())
        assert graphed._graphed_steps().matches_moments == has
        assert has == (method in ("lln", "lln_diag"))


def test_the_standin_overwrites_its_static_output_as_a_replay_does(gen, standin):
    """A graphed step's output is the graph's static tensor: the next step's replay overwrites it (what the
    documentation says a caller may not keep), as on a GPU; a copy taken is the step's."""
    _, graphed = pair("lln", "encoder")
    xs = [torch.randn(5, 2, E, generator=gen, dtype=torch.float64) for _ in range(2)]
    first, _ = graphed(xs[0], xs[0], xs[0], need_weights=False)
    kept = first.clone()
    first.sum().backward()
    second, _ = graphed(xs[1], xs[1], xs[1], need_weights=False)
    assert torch.equal(first, second) and not torch.equal(kept, second)
    assert copy.deepcopy(graphed.state_dict()).keys() == graphed.state_dict().keys()  # no graph in the state


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulate_across_graphed_steps_as_eagerly(gen, standin, set_to_none):
    """Three steps' gradients summed into ``.grad`` (fairseq's ``--update-freq 3``), after a ``zero_grad`` that sets
    them to None or zeroes them in place: what eager steps sum. A replay returns the backward graph's static tensors
    (as ``make_graphed_callables`` does, which the stand-in keeps), so a parameter's ``.grad`` taken from one would be
    overwritten by the next replay."""
    eager, graphed = pair("lln", "decoder")
    xs = [torch.randn(6, 2, E, generator=gen, dtype=torch.float64) for _ in range(3)]
    for module in (eager, graphed):
        for _ in range(2):  # a capture, then replays from a .grad already there
            module.zero_grad(set_to_none=set_to_none)
            for x in xs:
                out, _ = module(x, x, x, need_weights=False)
                out.sum().backward()
    for (name, got), want in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert len(standin) == 1


def test_a_copy_of_a_graphed_module_captures_its_own_graphs(gen, standin):
    """``copy.deepcopy`` (fairseq's EMA model) of a module that captured: the copy keeps no graph of the original's
    (they read the original's tensors), captures its own and copies its gradients out of them too (two steps'
    gradients accumulated equal eager's); the original is left as it was."""
    eager, graphed = pair("lln", "encoder")
    x = torch.randn(6, 2, E, generator=gen, dtype=torch.float64)
    for module in (eager, graphed):
        module(x, x, x, need_weights=False)[0].sum().backward()
    twins = copy.deepcopy(eager), copy.deepcopy(graphed)
    assert "_cuda_graphs" not in twins[1].__dict__ and len(graphed.__dict__["_cuda_graphs"].graphs) == 1
    xs = [torch.randn(6, 2, E, generator=gen, dtype=torch.float64) for _ in range(2)]
    for module in twins:
        module.zero_grad(set_to_none=True)
        for xi in xs:
            module(xi, xi, xi, need_weights=False)[0].sum().backward()
    for got, want in zip(twins[1].parameters(), twins[0].parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    assert len(standin) == 2 and len(twins[1].__dict__["_cuda_graphs"].graphs) == 1


@pytest.mark.parametrize("takes_mode", [False, True])
def test_captures_run_in_thread_local_mode_whatever_torch_takes(monkeypatch, takes_mode):
    """Another thread's CUDA calls (fairseq's DataLoader pins memory in one) must not break a capture taken
    mid-epoch: ``make_graphed_callables`` is given ``capture_error_mode="thread_local"`` where it takes it, else the
    ``torch.cuda.graph`` it opens is, and is put back after (torch 2.13's takes none)."""
    seen = []
    opened = torch.cuda.graph

    def make(step, args, num_warmup_iters, allow_unused_input, **mode):
        seen.append((mode or torch.cuda.graph.keywords, num_warmup_iters, allow_unused_input))
        return "graphed"

    if takes_mode:
        def make_with_mode(step, args, num_warmup_iters=3, allow_unused_input=False, pool=None,
                           capture_error_mode="global"):
            return make(step, args, num_warmup_iters, allow_unused_input, capture_error_mode=capture_error_mode)
        monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_with_mode)
    else:
        monkeypatch.setattr(torch.cuda, "make_graphed_callables", make)
    assert cuda_graph.graphed_callables(None, ()) == "graphed"
    assert seen == [({"capture_error_mode": "thread_local"}, cuda_graph.WARMUP, True)]
    assert torch.cuda.graph is opened

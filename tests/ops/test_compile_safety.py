"""The ops under ``torch.compile`` without the torch version that broke them (docs/design.md §1.4): torch 2.11 could
not trace the autocast check (a graph break in every op) and gave wrong gradients for an ``autograd.Function`` whose
output aliases another value of its forward or was written in place (pytorch#180642). Here, on any torch: no graph
break even where Dynamo cannot trace the check, every Function returns a fresh output while compiling, and compiled
gradients equal eager ones with a graph break forced inside each op."""
import contextlib

import pytest
import torch
import torch._dynamo

from linattn import ops
from linattn.ops import precision

N, D = 19, 8  # odd, shorter than one chunk of the defaults: small compiles


def _lavo_params(gen):
    return ops.lavo_init_bases(2, 4, D), torch.randn(2, 2 * 5 - 1, generator=gen)


def _calls(gen):
    """name -> (q, k, v, mask) -> output, one per op with a hand-written backward (alpha != beta)."""
    bases, bias = _lavo_params(gen)
    return {
        "lln": lambda q, k, v, m, impl: ops.lln_attention(q, k, v, 0.7, 1.3, key_padding_mask=m, chunk_size=8,
                                                          impl=impl),
        "lln causal": lambda q, k, v, m, impl: ops.lln_attention(q, k, v, 0.7, 1.3, causal=True, chunk_size=8,
                                                                 key_padding_mask=m, impl=impl),
        "lln_diag causal": lambda q, k, v, m, impl: ops.lln_diag_attention(q, k, v, 0.7, 1.3, causal=True,
                                                                           block_size=8, chunk_size=8,
                                                                           key_padding_mask=m, impl=impl),
        "block_softmax": lambda q, k, v, m, impl: ops.block_softmax_attention(q, k, v, block_size=8,
                                                                              key_padding_mask=m, impl=impl),
        "skyformer": lambda q, k, v, m, impl: ops.skyformer_attention(q, k, v, num_landmarks=6, training=False,
                                                                      key_padding_mask=m, impl=impl),
        "kernelized": lambda q, k, v, m, impl: ops.kernelized_attention(q, k, v, key_padding_mask=m, impl=impl),
        "lavo causal": lambda q, k, v, m, impl: ops.lavo_attention(q, k, v, bases, bias, window=5, causal=True,
                                                                   key_padding_mask=m, impl=impl),
    }


CALLS = list(_calls(torch.Generator().manual_seed(0)))


def _inputs(gen):
    q, k, v = (torch.randn(2, 2, N, D, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, N, dtype=torch.bool)
    mask[1, :4] = True  # left padding in one row
    return q, k, v, mask


@contextlib.contextmanager
def _untraceable_autocast_check():
    """``torch.amp.is_autocast_available`` as Dynamo sees it before torch 2.12: a call it cannot trace."""
    real = torch.amp.is_autocast_available
    torch.amp.is_autocast_available = torch._dynamo.disable(real)
    try:
        yield
    finally:
        torch.amp.is_autocast_available = real


def test_the_autocast_check_breaks_no_graph_where_dynamo_cannot_trace_it(gen):
    q, k, v, mask = _inputs(gen)
    torch._dynamo.reset()
    call = _calls(gen)["lln causal"]
    with _untraceable_autocast_check():
        out = torch.compile(lambda *a: call(*a, "parallel"), fullgraph=True, backend="eager")(q, k, v, mask)
    torch.testing.assert_close(out, call(q, k, v, mask, "parallel"))


@pytest.mark.parametrize("impl", ["parallel", "looped"])
@pytest.mark.parametrize("name", CALLS)
def test_every_op_returns_a_fresh_output_while_compiling(monkeypatch, gen, name, impl):
    """While compiling, the op's output is written by no op after it is made and shares memory with nothing its
    Function saves for backward (run eagerly with ``is_compiling`` true: the code path a trace records)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, mask = _inputs(gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _calls(gen)[name](q, k, v, mask, impl)
    assert out._version == 0 and out._base is None
    shared = [t.shape for t in saved if t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()]
    assert not shared, f"the output shares memory with saved tensors of shapes {shared}"


@pytest.mark.parametrize("name", CALLS)
def test_compiled_gradients_equal_eager_with_a_graph_break_inside_the_op(gen, name):
    """A graph break where one could happen (the autocast check, as torch 2.11 traced it) leaves the values and
    every input gradient as eager computes them (``aot_eager``: the autograd graph as Inductor gets it)."""
    q, k, v, mask = _inputs(gen)
    call = _calls(gen)[name]
    g = torch.randn(2, 2, N, D, generator=gen)
    want = torch.autograd.grad(call(q, k, v, mask, "parallel"), (q, k, v), g)
    torch._dynamo.reset()
    real_check = precision.has_autocast

    def breaking_check(device_type):
        torch._dynamo.graph_break()
        return real_check(device_type)

    precision.has_autocast = breaking_check
    try:
        out = torch.compile(lambda *a: call(*a, "parallel"), backend="aot_eager")(q, k, v, mask)
    finally:
        precision.has_autocast = real_check
    torch.testing.assert_close(out, call(q, k, v, mask, "parallel"), rtol=1e-5, atol=1e-6)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), g), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

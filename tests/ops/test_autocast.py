"""Under torch.autocast (fairseq's --amp) every linear op still computes in float32: autocast would
otherwise run its internal matmuls in half precision (measured here before the fix: up to 9e-3
relative error in bf16 against the same op without autocast)."""
import pytest
import torch
from helpers import rel_err

from linattn import ops
from linattn.ops.lln import lln_decode_init, lln_decode_step

B, H, N, D = 2, 3, 70, 16


def _lavo_params():
    """Bases and a non-zero relative bias for window 8 (fixed per test by the global seed of torch)."""
    return ops.lavo_init_bases(H, D, D), 0.3 * torch.ones(H, 2 * 8 - 1).cumsum(-1).sin()


def _op(name, causal):
    bases, pos_bias = _lavo_params()
    return {
        "lln": lambda q, k, v: ops.lln_attention(q, k, v, 1.5, 1.5, causal=causal, chunk_size=16),
        "lln_diag": lambda q, k, v: ops.lln_diag_attention(q, k, v, 1.5, 1.5, causal=causal, block_size=16),
        "block_softmax": lambda q, k, v: ops.block_softmax_attention(q, k, v, causal=causal, block_size=16),
        "lavo": lambda q, k, v: ops.lavo_attention(q, k, v, bases, pos_bias, window=8, causal=causal),
        "lavo_cross": lambda q, k, v: ops.lavo_cross_readout(q, *ops.lavo_cross_memory(v, bases), bases),
        "kernelized": lambda q, k, v: ops.kernelized_attention(q, k, v),
        "skyformer": lambda q, k, v: ops.skyformer_attention(q, k, v, num_landmarks=16, training=False),
    }[name]


CASES = [(m, c) for m in ("lln", "lln_diag", "block_softmax", "lavo") for c in (False, True)] + \
    [("lavo_cross", False), ("kernelized", False), ("skyformer", False)]


@pytest.mark.parametrize("method,causal", CASES)
def test_ops_compute_in_float32_under_autocast(gen, method, causal):
    op = _op(method, causal)
    q, k, v = (torch.randn(B, H, N, D, generator=gen, requires_grad=True) for _ in range(3))
    want = op(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v), allow_unused=True)  # LAVO cross reads no keys
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = op(q, k, v)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v), allow_unused=True)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    for g, w in zip(got_grads, want_grads):
        assert (g is None) == (w is None) and (g is None or rel_err(g, w) < 1e-6)


@pytest.mark.parametrize("method,causal", CASES)
def test_half_inputs_under_autocast_give_what_they_give_without_it(gen, method, causal):
    op = _op(method, causal)
    q, k, v = (torch.randn(B, H, N, D, generator=gen).bfloat16() for _ in range(3))
    want = op(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = op(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _decode(method, q, k, v, bases, pos_bias):
    """Token-by-token decoding of (B, H, T, D) inputs with the op's own decode step."""
    if method == "lln":
        s, shift = lln_decode_init(B, H, D, D)
        step = lambda t, s, shift: lln_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                   1.5, 1.5, s, shift)
        outs = []
        for t in range(q.shape[2]):
            out, s, shift = step(t, s, shift)
            outs.append(out)
        return torch.cat(outs, 2)
    state, outs = ops.lavo_init_state(B, H, D, D, window=8), []
    for t in range(q.shape[2]):
        out, state = ops.lavo_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], bases, pos_bias,
                                          state, window=8)
        outs.append(out)
    return torch.cat(outs, 2)


@pytest.mark.parametrize("method", ["lln", "lavo"])
def test_decode_steps_compute_in_float32_under_autocast(gen, method):
    q, k, v = (torch.randn(B, H, 20, D, generator=gen) for _ in range(3))
    lavo = _lavo_params()
    want = _decode(method, q, k, v, *lavo)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _decode(method, q, k, v, *lavo)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6


def test_an_op_enters_no_autocast_context_where_autocast_is_off(gen, monkeypatch):
    """``autocast_off`` turns autocast off only where it is on: without ``torch.autocast`` around the call (fp32 and
    --fp16 training) the op runs as it is (the context costs the host about 5 µs a call); under it, the op still
    turns it off, once."""
    entered = []
    autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **kw: entered.append(kw) or autocast(*a, **kw))
    op = _op("lln", True)
    q, k, v = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))
    want = op(q, k, v)
    assert entered == []
    with autocast(device_type="cpu", dtype=torch.bfloat16):
        got = op(q, k, v)
    assert entered == [{"device_type": "cpu", "enabled": False}]
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6

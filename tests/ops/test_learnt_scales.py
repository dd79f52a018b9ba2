"""LLN's scales alpha, beta as learnt (gradient-requiring) tensors, alpha != beta: every form of the ops that take
them (LLN, LLN+Diag's fused average and its learnable mixes, decoding) equals the float64 reference in value
and in the gradients of q, k, v, alpha and beta, causal or not, padded on either side."""
import pytest
import torch
from helpers import assert_same_values_and_grads, padding_mask

from linattn import ops
from linattn.ops import working_set

IMPLS = ["parallel", "looped"]  # the ops' implementations (linattn.ops.impls); working passes concern ``looped`` only

B, H, N, D, DV = 3, 3, 21, 5, 4


def _inputs(gen, n=N):
    q, k = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    return q, k, torch.randn(B, H, n, DV, generator=gen, dtype=torch.float64).requires_grad_()


def _scales(gen, shape: str):
    """alpha, beta requiring grad, alpha != beta: per head (1,H,1,1), per sequence and head (B,H,1,1) or 0-d."""
    size = {"head": (1, H, 1, 1), "batch_head": (B, H, 1, 1), "scalar": ()}[shape]
    alpha = torch.rand(size, generator=gen, dtype=torch.float64) * 0.4 + 1.2  # in [1.2, 1.6)
    beta = torch.rand(size, generator=gen, dtype=torch.float64) * 0.4 + 0.5  # in [0.5, 0.9): never alpha
    return alpha.requires_grad_(), beta.requires_grad_()


def _mask(gen, n=N):
    """(B, n): sequence 0 unpadded, 1 padded on the left, 2 on the right (random amounts < n)."""
    return torch.cat([padding_mask(2, n, "left", gen), padding_mask(2, n, "right", gen)[1:]])


@pytest.fixture(params=[False, True], ids=["one-pass", "many-passes"])
def passes(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(working_set, "WORK_ELEMENTS", 1)  # one row / one chunk per working pass


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", ["head", "batch_head", "scalar"])
@pytest.mark.parametrize("causal", [False, True])
def test_lln_learnt_scales_match_reference_values_and_grads(gen, passes, shape, causal, impl):
    q, k, v = _inputs(gen)
    alpha, beta = _scales(gen, shape)
    mask = _mask(gen)
    out = ops.lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=mask, chunk_size=4, impl=impl)
    ref = ops.lln_attention_reference(q, k, v, alpha, beta, causal=causal, key_padding_mask=mask)
    assert_same_values_and_grads(out, ref, (q, k, v, alpha, beta), gen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mix", ["average", "learnable_scale"])
@pytest.mark.parametrize("shape", ["head", "scalar"])
@pytest.mark.parametrize("causal", [False, True])
def test_lln_diag_learnt_scales_match_reference_values_and_grads(gen, mix, shape, causal, impl):
    q, k, v = _inputs(gen)
    alpha, beta = _scales(gen, shape)
    mask = _mask(gen)
    r, p = (torch.rand(H, DV, generator=gen, dtype=torch.float64) + 0.1 for _ in range(2))
    kw = dict(block_size=5, causal=causal, key_padding_mask=mask, chunk_size=4, mix=mix, r=r, p=p)
    out = ops.lln_diag_attention(q, k, v, alpha, beta, **kw, impl=impl)
    ref = ops.lln_diag_attention_reference(q, k, v, alpha, beta, **kw)
    assert_same_values_and_grads(out, ref, (q, k, v, alpha, beta), gen)


@pytest.mark.parametrize("shape", ["head", "scalar"])
def test_lln_decoding_with_learnt_scales_matches_causal_reference(gen, shape):
    q, k, v = _inputs(gen, n=9)
    alpha, beta = _scales(gen, shape)
    mask = _mask(gen, 9)
    s, shift = ops.lln_decode_init(B, H, D, DV, dtype=torch.float64)
    steps = []
    for t in range(9):
        o, s, shift = ops.lln_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], alpha, beta, s,
                                          shift, key_padding_mask=mask[:, t:t + 1])
        steps.append(o)
    ref = ops.lln_attention_reference(q, k, v, alpha, beta, causal=True, key_padding_mask=mask)
    assert_same_values_and_grads(torch.cat(steps, 2), ref, (q, k, v, alpha, beta), gen)


@pytest.mark.parametrize("impl", IMPLS)
def test_learnt_and_fixed_scales_give_the_same_output(gen, impl):
    """The learnt path (scales folded into q and k) and the constant path agree, so neither can swap them."""
    q, k, v = (t.detach() for t in _inputs(gen))
    alpha, beta = (t.detach() for t in _scales(gen, "head"))
    mask = _mask(gen)
    for causal in (False, True):
        fixed = ops.lln_attention(q, k, v, alpha, beta, causal=causal, key_padding_mask=mask, chunk_size=4, impl=impl)
        learnt = ops.lln_attention(q, k, v, alpha.clone().requires_grad_(), beta.clone().requires_grad_(),
                                   causal=causal, key_padding_mask=mask, chunk_size=4, impl=impl)
        torch.testing.assert_close(learnt, fixed, rtol=1e-10, atol=1e-12)

"""The fairseq attention modules: fairseq parity (softmax), incremental decoding, layout, errors."""
import pytest
import torch
from fairseq.modules import MultiheadAttention

from fairseq_linattn.modules import build_attention
from conftest import rel_err

E, H = 32, 4


def copy_projections(src, dst):
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(dst, name).load_state_dict(getattr(src, name).state_dict())


def test_softmax_module_equals_fairseq_multihead_attention_encoder(gen):
    ref = MultiheadAttention(E, H, self_attention=True).eval()
    ours = build_attention("softmax", E, H, causal=False).eval()
    copy_projections(ref, ours)
    x = torch.randn(9, 3, E, generator=gen)
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, -3:] = True
    want, _ = ref(x, x, x, key_padding_mask=mask, need_weights=False)
    got, _ = ours(x, x, x, key_padding_mask=mask, need_weights=False)
    assert rel_err(got, want) < 1e-5


def test_softmax_module_equals_fairseq_multihead_attention_incremental_decoder(gen):
    ref = MultiheadAttention(E, H, self_attention=True).eval()
    ours = build_attention("softmax", E, H, causal=True).eval()
    copy_projections(ref, ours)
    x = torch.randn(7, 2, E, generator=gen)
    state_ref, state_ours, outs_ref, outs_ours = {}, {}, [], []
    for t in range(7):
        xt = x[t:t + 1]
        outs_ref.append(ref(xt, xt, xt, incremental_state=state_ref, need_weights=False)[0])
        outs_ours.append(ours(xt, xt, xt, incremental_state=state_ours, need_weights=False)[0])
    assert rel_err(torch.cat(outs_ours), torch.cat(outs_ref)) < 1e-5
    future = torch.triu(torch.full((7, 7), float("-inf")), 1)
    full_ref = ref(x, x, x, attn_mask=future, need_weights=False)[0]
    assert rel_err(ours(x, x, x, attn_mask=future, need_weights=False)[0], full_ref) < 1e-5


OPTS = {"lln_chunk_size": 4, "lln_diag_block_size": 3, "lavo_window": 3, "lln_diag_mix": "learnable_scale"}


@pytest.mark.parametrize("method", ["softmax", "lln", "lln_diag", "lavo"])
def test_incremental_decoding_equals_full_forward(gen, method):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fresh weights too
    m = build_attention(method, E, H, causal=True, opts=OPTS).eval()
    x = torch.randn(11, 2, E, generator=gen)
    full, _ = m(x, x, x, attn_mask=torch.triu(torch.full((11, 11), float("-inf")), 1))
    state, outs = {}, []
    for t in range(11):
        outs.append(m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state)[0])
    assert rel_err(torch.cat(outs), full) < 1e-5


@pytest.mark.parametrize("method", ["lln", "lln_diag", "lavo", "softmax"])
def test_reorder_incremental_state_follows_beams(gen, method):
    m = build_attention(method, E, H, causal=True, opts=OPTS).eval()
    x = torch.randn(5, 3, E, generator=gen)
    state_a, state_b = {}, {}
    order = torch.tensor([2, 0, 1])
    for t in range(4):
        m(x[t:t + 1], None, None, incremental_state=state_a)
        m(x[t:t + 1, order], None, None, incremental_state=state_b)
    m.reorder_incremental_state(state_a, order)
    out_a = m(x[4:5, order], None, None, incremental_state=state_a)[0]
    out_b = m(x[4:5, order], None, None, incremental_state=state_b)[0]
    torch.testing.assert_close(out_a, out_b)


@pytest.mark.parametrize("method", ["skyformer", "kernelized"])
def test_non_causal_methods_refuse_to_be_causal(method):
    with pytest.raises(ValueError, match="non-causal"):
        build_attention(method, E, H, causal=True)


@pytest.mark.parametrize("method", ["softmax", "lln", "lln_diag", "skyformer", "kernelized", "lavo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_modules_run_in_half_precision(gen, method, dtype):
    m = build_attention(method, E, H, causal=False, opts={"skyformer_landmarks": 8}).to(dtype)
    x = torch.randn(20, 2, E, generator=gen).to(dtype)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, -5:] = True
    out, _ = m(x, x, x, key_padding_mask=mask)
    assert out.dtype == dtype and out.shape == (20, 2, E) and torch.isfinite(out).all()
    out.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_encoder_module_rejects_arbitrary_attn_mask(gen):
    m = build_attention("lln", E, H, causal=False)
    x = torch.randn(4, 1, E, generator=gen)
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(4, 4))


@pytest.mark.parametrize("need_head_weights", [False, True])
def test_softmax_module_returns_fairseq_attention_weights(gen, need_head_weights):
    ref = MultiheadAttention(E, H, self_attention=True).eval()
    ours = build_attention("softmax", E, H, causal=False).eval()
    copy_projections(ref, ours)
    x = torch.randn(6, 2, E, generator=gen)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    _, want = ref(x, x, x, key_padding_mask=mask, need_weights=True, need_head_weights=need_head_weights)
    _, got = ours(x, x, x, key_padding_mask=mask, need_weights=True, need_head_weights=need_head_weights)
    if need_head_weights:  # MHA's documented per-head layout; its own fast path returns the mean anyway
        assert got.shape == (H, 2, 6, 6)
        got = got.mean(0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_linear_modules_return_no_weights(gen):
    m = build_attention("lln", E, H, causal=False)
    x = torch.randn(5, 1, E, generator=gen)
    assert m(x, x, x, need_weights=True)[1] is None

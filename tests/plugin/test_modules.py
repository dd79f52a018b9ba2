"""The fairseq attention modules: fairseq parity (softmax), incremental decoding, layout, errors."""
import pytest
import torch
from fairseq.modules import MultiheadAttention
from helpers import rel_err

from fairseq_linattn.modules import build_attention
from linattn.methods import METHODS, methods_for

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


@pytest.mark.parametrize("method", methods_for("decoder"))
def test_incremental_decoding_equals_full_forward(gen, method):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fresh weights too
    m = build_attention(method, E, H, causal=True, config=OPTS).eval()
    x = torch.randn(11, 2, E, generator=gen)
    full, _ = m(x, x, x, attn_mask=torch.triu(torch.full((11, 11), float("-inf")), 1))
    state, outs = {}, []
    for t in range(11):
        outs.append(m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state)[0])
    assert rel_err(torch.cat(outs), full) < 1e-5


@pytest.mark.parametrize("method", methods_for("decoder"))
def test_reorder_incremental_state_follows_beams(gen, method):
    m = build_attention(method, E, H, causal=True, config=OPTS).eval()
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


@pytest.mark.parametrize("method", sorted(set(METHODS) - set(methods_for("decoder"))))
def test_non_causal_methods_refuse_to_be_causal(method):
    with pytest.raises(ValueError, match="non-causal"):
        build_attention(method, E, H, causal=True)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_modules_run_in_half_precision(gen, method, dtype):
    m = build_attention(method, E, H, causal=False, config={"skyformer_landmarks": 8}).to(dtype)
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


# -- decoding padded batches: each step gets fairseq's (B, 1) mask, or None when the step has no pad --
PAD_OPTS = {
    "lln_fixed": {**OPTS, "lln_moment_matching": "off", "lln_alpha": 1.3, "lln_beta": 0.6},
    "lln_ema": {**OPTS, "lln_stats_per_head": True},  # EMA statistics set apart below: alpha != beta per head
}


def decode_masks(t: int) -> torch.Tensor:
    """(3, T): left-padded, right-padded, and padded on both sides and in the middle."""
    mask = torch.zeros(3, t, dtype=torch.bool)
    mask[0, : t // 2] = True
    mask[1, t - t // 3:] = True
    mask[2, :2] = mask[2, t // 2] = mask[2, -1] = True
    return mask


def padded_decoder_module(method: str, opts_name: str, gen) -> torch.nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # fresh weights too
    m = build_attention(method, E, H, causal=True, config=PAD_OPTS[opts_name]).eval()
    if hasattr(m, "pos_bias"):
        torch.nn.init.normal_(m.pos_bias)
    if hasattr(m, "matcher") and opts_name == "lln_ema":
        m.matcher.ema_var_q.uniform_(0.3, 1.0)  # disjoint ranges: alpha / beta = sigma_k / sigma_q >= 1.26
        m.matcher.ema_var_k.uniform_(1.6, 3.0)
    if getattr(m, "mix_r", None) is not None:
        torch.nn.init.uniform_(m.mix_r)
        torch.nn.init.uniform_(m.mix_p)
    if hasattr(m, "matcher"):
        alpha, beta = m.matcher.current(torch.zeros(3, H, 1, E // H))
        assert (alpha - beta).abs().min() > 0.05  # a swapped alpha/beta must show
    return m


def decode(m, x, mask, order=None, switch_at=0):
    """Feed x (T, B, C) token by token as fairseq's decoder does; reorder the state (beams) at ``switch_at``
    and return the outputs from there on."""
    state, outs = {}, []
    for t in range(x.shape[0]):
        if t == switch_at and order is not None:
            outs = []
            m.reorder_incremental_state(state, order)
            x, mask = x[:, order], mask[order]
        step_mask = mask[:, t:t + 1] if mask[:, t].any() else None
        outs.append(m(x[t:t + 1], x[t:t + 1], x[t:t + 1], key_padding_mask=step_mask, incremental_state=state)[0])
    return torch.cat(outs)


@pytest.mark.parametrize("method,opts_name", [("softmax", "lln_fixed"), ("lln", "lln_fixed"), ("lln", "lln_ema"),
                                              ("lln_diag", "lln_fixed"), ("lln_diag", "lln_ema"),
                                              ("lavo", "lln_fixed")])
def test_padded_incremental_decoding_equals_full_forward(gen, method, opts_name):
    """Left, right and middle padding (padded inputs huge): every real token's output equals the full forward's."""
    m = padded_decoder_module(method, opts_name, gen)
    t = 14
    mask = decode_masks(t)
    x = torch.randn(t, 3, E, generator=gen).masked_fill(mask.t()[:, :, None], 30.0)
    full, _ = m(x, x, x, key_padding_mask=mask)
    real = ~mask.t()
    assert rel_err(decode(m, x, mask)[real], full[real]) < 1e-5


@pytest.mark.parametrize("method", methods_for("decoder"))
def test_beam_reordering_after_a_padded_prefix_equals_full_forward(gen, method):
    """Reorder (and expand, as beam search does) the state mid-decode: the padding masks in it follow."""
    m = padded_decoder_module(method, "lln_ema" if method != "softmax" else "lln_fixed", gen)
    t, switch = 14, 7
    mask = decode_masks(t)
    x = torch.randn(t, 3, E, generator=gen).masked_fill(mask.t()[:, :, None], 30.0)
    order = torch.tensor([2, 0, 1, 2, 0, 1])
    out = decode(m, x, mask, order, switch)
    full, _ = m(x[:, order], x[:, order], x[:, order], key_padding_mask=mask[order])
    real = ~mask[order].t()[switch:]
    assert rel_err(out[real], full[switch:][real]) < 1e-5


# -- attn_mask: the future mask is what a causal module does anyway; anything else is refused or applied --
@pytest.mark.parametrize("method", methods_for("decoder"))
def test_causal_module_accepts_the_future_mask_float_or_bool(gen, method):
    m = build_attention(method, E, H, causal=True, config=OPTS).eval()
    x = torch.randn(9, 2, E, generator=gen)
    plain, _ = m(x, x, x)
    for future in (torch.triu(torch.full((9, 9), float("-inf")), 1), torch.ones(9, 9, dtype=torch.bool).triu(1)):
        torch.testing.assert_close(m(x, x, x, attn_mask=future)[0], plain)


@pytest.mark.parametrize("method", ["lln", "lln_diag", "lavo"])
@pytest.mark.parametrize("kind", ["band", "shifted", "all_open", "finite"])
def test_causal_linear_module_refuses_any_other_attn_mask(gen, method, kind):
    m = build_attention(method, E, H, causal=True, config=OPTS)
    x = torch.randn(6, 2, E, generator=gen)
    future = torch.triu(torch.full((6, 6), float("-inf")), 1)
    mask = {"band": future.masked_fill(torch.ones(6, 6, dtype=torch.bool).tril(-3), float("-inf")),
            "shifted": torch.triu(torch.full((6, 6), float("-inf")), 2),
            "all_open": torch.zeros(6, 6),
            "finite": future.masked_fill(torch.eye(6, dtype=torch.bool), -2.0)}[kind]
    with pytest.raises(ValueError, match=f"causal {method} attention takes the standard causal.*taken by: softmax"):
        m(x, x, x, attn_mask=mask)


def test_softmax_module_applies_an_arbitrary_attn_mask_like_fairseq(gen):
    """A band mask (float) and its bool twin: equal to fairseq's MultiheadAttention with the same mask."""
    ref = MultiheadAttention(E, H, self_attention=True).eval()
    ours = build_attention("softmax", E, H, causal=True).eval()
    copy_projections(ref, ours)
    x = torch.randn(8, 2, E, generator=gen)
    band = torch.triu(torch.full((8, 8), float("-inf")), 1)
    band = band.masked_fill(torch.ones(8, 8, dtype=torch.bool).tril(-3), float("-inf"))
    want, _ = ref(x, x, x, attn_mask=band, need_weights=False)
    assert rel_err(ours(x, x, x, attn_mask=band)[0], want) < 1e-5
    assert rel_err(ours(x, x, x, attn_mask=torch.isneginf(band))[0], want) < 1e-5
    assert rel_err(ours(x, x, x, attn_mask=None)[0], want) > 1e-2  # the band mattered


def test_causal_module_refuses_an_attn_mask_while_decoding(gen):
    m = build_attention("lavo", E, H, causal=True, config=OPTS)
    x = torch.randn(1, 2, E, generator=gen)
    with pytest.raises(ValueError, match="none while decoding"):
        m(x, x, x, attn_mask=torch.zeros(1, 1), incremental_state={})


# -- LAVO cross-attention: the source memory is computed once per source and kept (static_kv) ------------
def count_calls(module):
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_lavo_cross_attention_reads_its_source_once_while_decoding(gen):
    m = build_attention("lavo", E, H, causal=False, cross=True, config=OPTS).eval()
    src = torch.randn(10, 3, E, generator=gen)
    src_mask = torch.zeros(3, 10, dtype=torch.bool)
    src_mask[1, :4] = True  # fairseq left-pads sources
    src_mask[2, -2:] = True
    src = src.masked_fill(src_mask.t()[:, :, None], 1e3)
    y = torch.randn(6, 3, E, generator=gen)
    full, _ = m(y, src, src, key_padding_mask=src_mask)
    v_calls, k_calls = count_calls(m.v_proj), count_calls(m.k_proj)
    state, outs = {}, []
    for t in range(6):
        if t == 3:
            m.reorder_incremental_state(state, torch.tensor([2, 1, 0]))
            y, full = y[:, [2, 1, 0]], full[:, [2, 1, 0]]
        outs.append(m(y[t:t + 1], src, src, key_padding_mask=src_mask, incremental_state=state, static_kv=True)[0])
    assert len(v_calls) == 1 and len(k_calls) == 0
    assert rel_err(torch.cat(outs[3:]), full[3:]) < 1e-5
    assert rel_err(torch.cat(outs[:3]), full[:3, [2, 1, 0]]) < 1e-5


@pytest.mark.parametrize("method,kw", [(m, {}) for m in METHODS] + [(m, {"cross": True}) for m in methods_for("cross")])
def test_every_trainable_parameter_gets_a_gradient(gen, method, kw):
    """DDP's default (find_unused_parameters=False) fails on a trainable parameter that gets no gradient."""
    opts = {**OPTS, "lln_diag_mix": "learnable_scale", "skyformer_landmarks": 4}
    m = build_attention(method, E, H, causal=False, config=opts, **kw)
    x, src = torch.randn(7, 2, E, generator=gen), torch.randn(5, 2, E, generator=gen)
    key = src if kw else x
    m(x, key, key)[0].square().sum().backward()
    unused = [name for name, p in m.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused


def test_each_module_types_chosen_implementation_is_logged_once(gen, caplog, monkeypatch):
    """``--attention-impl auto`` (and a name a method has no implementation of) is a choice: the first forward of
    each module type says at INFO what its op runs and why; an implementation named and run, SDPA and the
    cross-attentions' read-outs say nothing."""
    from fairseq_linattn.modules import base

    monkeypatch.setattr(base, "_SAID", set())
    x = torch.randn(5, 2, E, generator=gen)
    caplog.set_level("INFO", logger=base.logger.name)
    modules = [build_attention("lln", E, H, causal=False), build_attention("lln", E, H, causal=False),
               build_attention("lln", E, H, causal=True), build_attention("softmax", E, H, causal=False),
               build_attention("lln", E, H, causal=False, config={"attention_impl": "parallel"}),
               build_attention("kernelized", E, H, causal=False, config={"attention_impl": "fused"}),
               build_attention("lavo", E, H, causal=False, cross=True)]
    for module in modules * 2:
        module(x, x, x)
    assert [r.getMessage() for r in caplog.records] == [
        "linattn: lln encoder self-attention runs 'looped' (auto on cpu)",
        "linattn: lln decoder self-attention runs 'looped' (auto on cpu)",
        "linattn: kernelized encoder self-attention runs 'parallel' (asked for: the method has no 'fused' "
        "implementation)"]

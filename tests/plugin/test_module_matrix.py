"""The attention matrix of each attention module (its ``attention_rows``) reproduces (or, as documented,
explains) its output."""
import math

import pytest
import torch
from helpers import padding_mask

from fairseq_linattn.analysis.module_matrix import module_attention_matrix, projected_qk
from fairseq_linattn.modules import build_attention
from linattn.analysis import entropy, spectral_gap
from linattn.ops import lavo_token_mixing

E, H, T, B = 16, 2, 23, 3


def make(method, causal, gen, **opts):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(method, E, H, causal=causal, config={"lln_chunk_size": 8, "lln_diag_block_size": 5,
                                                                  "lavo_window": 4, **opts})
    for p in module.parameters():  # move learnable extras (bias, mix weights) off their initial values
        if p.dim() < 2 and p.requires_grad:
            torch.nn.init.uniform_(p, 0.1, 0.9)
    return module.double().eval()


def inputs(gen, side="right"):
    x = torch.randn(T, B, E, generator=gen, dtype=torch.float64)
    return x, padding_mask(B, T, side, gen)


def values(module, x):
    return module._heads(module.v_proj(x))


def attend(module, x, pad):
    q, k = projected_qk(module, x)
    return module.attend(q, k, values(module, x), pad)


def check_rows_stochastic(P, pad):
    sums = P.sum(-1)  # rows of real (non-padded) queries sum to 1
    real = ~pad[:, None, :].expand_as(sums)
    torch.testing.assert_close(sums[real], torch.ones_like(sums[real]), rtol=0, atol=1e-10)
    assert bool((P >= 0).all()) and bool((P.masked_select(pad[:, None, None, :].expand_as(P)) == 0).all())


@pytest.mark.parametrize("method, causal, side, opts", [
    ("softmax", False, "right", {}), ("softmax", True, "left", {}),
    ("lln", False, "left", {}), ("lln", True, "right", {}), ("lln", False, "right", {"lln_stats_per_head": True}),
    ("lln_diag", False, "left", {}), ("lln_diag", True, "right", {}),
])
def test_matrix_times_values_is_the_module_output(method, causal, side, opts, gen):
    module = make(method, causal, gen, **opts)
    x, pad = inputs(gen, side)
    P = module_attention_matrix(module, x, key_padding_mask=pad)
    assert P.shape == (B, H, T, T)
    check_rows_stochastic(P, pad)
    out = attend(module, x, pad)
    real = ~pad[:, None, :, None].expand_as(out)
    torch.testing.assert_close((P @ values(module, x))[real], out[real], rtol=1e-5, atol=1e-7)
    if causal:
        assert bool((P.triu(1) == 0).all())


@pytest.mark.parametrize("mix", ["learnable_ratio", "learnable_scale"])
def test_lln_diag_learnable_mix_is_exact_for_weights_constant_per_head(mix, gen):
    module = make("lln_diag", False, gen, lln_diag_mix=mix)
    with torch.no_grad():
        module.mix_r.copy_(torch.tensor([[0.3], [0.8]]).expand(H, E // H))
        if module.mix_p is not None:
            module.mix_p.copy_(torch.tensor([[0.9], [0.4]]).expand(H, E // H))
    x, pad = inputs(gen)
    P = module_attention_matrix(module, x, key_padding_mask=pad)
    check_rows_stochastic(P, pad)
    scale = 1.0 if mix == "learnable_ratio" else torch.tensor([1.2, 1.2]).view(1, H, 1, 1).double()
    out = attend(module, x, pad)
    real = ~pad[:, None, :, None].expand_as(out)
    torch.testing.assert_close((scale * (P @ values(module, x)))[real], out[real], rtol=1e-5, atol=1e-7)


def test_lln_matrix_leaves_ema_buffers_and_logging_values_alone(gen):
    module = make("lln", True, gen).float().train()  # decoder: EMA statistics
    x = torch.randn(T, B, E, generator=gen)
    module(x, x, x)  # a training forward folds this batch into the EMA and sets last_*
    buffers = module.matcher.ema_var_q.clone(), module.matcher.ema_var_k.clone()
    last_alpha = module.matcher.last_alpha
    q, k = projected_qk(module, 3 * x)
    params = module.lln_parameters(q, k)
    module_attention_matrix(module, 3 * x)
    assert torch.equal(module.matcher.ema_var_q, buffers[0]) and torch.equal(module.matcher.ema_var_k, buffers[1])
    assert module.matcher.last_alpha is last_alpha and module.training and module.matcher.training
    # the next training forward uses the EMA from before its batch: the same alpha as the analysis
    module(3 * x, 3 * x, 3 * x)
    torch.testing.assert_close(module.matcher.last_alpha, params["alpha"])


def test_kernel_methods_give_their_kernel_rows_normalised(gen):
    for method in ("kernelized", "skyformer"):
        module = make(method, False, gen, skyformer_landmarks=64, skyformer_exact_inverse=True)
        x, pad = inputs(gen)
        x = 0.3 * x  # small scores: the Nyström kernel stays positive, so no entry is clipped
        P = module_attention_matrix(module, x, key_padding_mask=pad)
        check_rows_stochastic(P, pad)
        q, k = projected_qk(module, x)
        out, row_sums = module.attend(q, k, values(module, x), pad), module.attend(q, k, torch.ones_like(q), pad)
        real = ~pad[:, None, :, None].expand_as(out)
        torch.testing.assert_close((row_sums * (P @ values(module, x)))[real], out[real], rtol=1e-5, atol=1e-7)
        assert not torch.allclose(row_sums[..., 0][real[..., 0]], torch.ones(1, dtype=out.dtype))  # not stochastic


@pytest.mark.parametrize("causal, side", [(True, "right"), (False, "left")])
def test_lavo_token_mixing_and_channel_projection_give_the_output(causal, side, gen):
    module = make("lavo", causal, gen)
    x, pad = inputs(gen, side)
    q, k = projected_qk(module, x)
    v = values(module, x)
    # the module counts positions over real tokens: it reads each row with its real tokens first
    order = torch.sort(pad.to(torch.uint8), dim=1, stable=True).indices
    back = order.argsort(1)
    tok = lambda t, o: t.gather(2, o[:, None, :, None].expand_as(t))
    local, memory, has_memory = lavo_token_mixing(tok(q, order), tok(k, order), module.pos_bias, window=module.window,
                                                  causal=causal, key_padding_mask=pad.gather(1, order))
    local, memory = (m.gather(2, back[:, None, :, None].expand_as(m)) for m in (local, memory))
    local, memory = (m.gather(3, back[:, None, None, :].expand_as(m)) for m in (local, memory))
    has_memory = has_memory.gather(1, back)
    # global part: Pi_t (m_t V), Pi_t = sum_i p_ti B_i B_i^T, p_t = softmax_i(q_t·(H_ti B_i)/sqrt(D)), H_t = B m_t V
    read = memory @ v  # (B, H, T, D)
    code = torch.einsum("bhtd,hrd->bhtr", read, module.bases)
    p = torch.softmax(torch.einsum("bhtd,hrd->bhtr", q, module.bases) * code / math.sqrt(E // H), -1)
    glob = torch.einsum("bhtr,hrd,hre,bhte->bhtd", p, module.bases, module.bases, read)
    expected = torch.where(has_memory[:, None, :, None], 0.5 * (local @ v + glob), local @ v)
    out = module.attend(q, k, v, pad)
    real = ~pad[:, None, :, None].expand_as(out)
    torch.testing.assert_close(expected[real], out[real], rtol=1e-5, atol=1e-7)
    P = module.attention_rows(q, k, key_padding_mask=pad)
    check_rows_stochastic(P, pad)
    assert not torch.allclose((P @ v)[real], out[real])  # the channel projection is not the identity


def test_sampled_rows_are_rows_of_the_full_matrix(gen):
    for method in ("softmax", "lln_diag", "lavo", "skyformer"):
        module = make(method, method != "skyformer", gen)
        x, pad = inputs(gen)
        full = module_attention_matrix(module, x, key_padding_mask=pad)
        index = torch.tensor([0, 4, 9, 22])
        torch.testing.assert_close(module_attention_matrix(module, x, key_padding_mask=pad, rows=index),
                                   full[:, :, index], rtol=1e-9, atol=1e-12)
        assert module_attention_matrix(module, x, rows=5).shape == (B, H, 5, T)
        assert entropy(full[0]).shape == spectral_gap(full[0]).shape == (H,)


def test_rejects_modules_without_an_attention_matrix(gen):
    from fairseq.modules import MultiheadAttention

    with pytest.raises(ValueError, match="fairseq_linattn attention module"):
        module_attention_matrix(MultiheadAttention(E, H), torch.randn(T, B, E))
    cross = build_attention("lavo", E, H, causal=False, cross=True)
    with pytest.raises(ValueError, match="cross-attention"):
        module_attention_matrix(cross, torch.randn(T, B, E))
    with pytest.raises(ValueError, match="query must be"):
        module_attention_matrix(make("softmax", False, gen), torch.randn(T, E))


@pytest.mark.parametrize("side", ["left", "right"])
def test_kernelized_kernel_rows_zero_the_padded_key_columns(side, gen):
    module = make("kernelized", False, gen)
    x, pad = inputs(gen, side)
    q, k = projected_qk(module, 0.3 * x)
    # padded keys equal to the queries: unmasked, their kernel entries would be exp(0) = 1 on the diagonal
    k = torch.where(pad[:, None, :, None], q, k)
    C = module.kernel_rows(q, k, pad)
    P = module.attention_rows(q, k, key_padding_mask=pad)
    cols = pad[:, None, None, :].expand_as(C)
    assert bool((C[cols] == 0).all()) and bool((P[cols] == 0).all())
    check_rows_stochastic(P, pad)
    for b in range(B):  # real rows and columns: the kernel of the sequence alone, without its padding
        real = ~pad[b]
        alone = module.kernel_rows(q[b:b + 1, :, real], k[b:b + 1, :, real], None)
        torch.testing.assert_close(C[b:b + 1][:, :, real][..., real], alone, rtol=1e-12, atol=0)

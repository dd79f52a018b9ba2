"""Row functions of the ops (``ops.*_weights``) and the modules' ``attention_rows``: one formula per method,
in the ops; ``analysis/`` only measures."""
import math
import re

import pytest
import torch
from helpers import ROOT, padding_mask

from fairseq_linattn.modules import ATTENTION_CLASSES, build_attention
from linattn import ops
from linattn.analysis import entropy, log_moments, sparsity, spectral_gap
from linattn_tools.methods_extra import METHODS_EXTRA

F64 = torch.float64
E, H, T, B = 16, 2, 23, 3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- shared helpers

def test_masked_softmax_gives_zero_rows_without_keys_and_keeps_nan():
    scores = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [float("nan"), 0.0, 0.0], [float("-inf")] * 3])
    allowed = torch.tensor([[True, True, True], [False, False, False], [True, True, True], [True, True, True]])
    P = ops.masked_softmax(scores, allowed)
    torch.testing.assert_close(P[0], scores[0].softmax(-1))
    assert torch.equal(P[1], torch.zeros(3)) and torch.equal(P[3], torch.zeros(3))
    assert bool(P[2].isnan().all())  # nothing hidden
    torch.testing.assert_close(ops.masked_softmax(scores[:2] + 1000), scores[:2].softmax(-1))  # shifted: no overflow


def test_select_rows():
    assert torch.equal(ops.select_rows(None, 4, "cpu"), torch.arange(4))
    assert torch.equal(ops.select_rows(4, 13, "cpu"), torch.tensor([0, 4, 8, 12]))
    assert torch.equal(ops.select_rows(99, 3, "cpu"), torch.arange(3))
    for bad in (0, True, torch.tensor([3]), torch.tensor([[0]]), torch.tensor([0.0])):
        with pytest.raises(ValueError, match="rows"):
            ops.select_rows(bad, 3, "cpu")


# ---------------------------------------------------------------- softmax and LLN rows (moved from analysis)

def test_softmax_and_lln_weights_match_formulas_and_sample_rows():
    g = _gen(6)
    B_, H_, N, D = 2, 3, 13, 5
    q, k = (torch.randn(B_, H_, N, D, generator=g, dtype=F64) for _ in range(2))
    pad = torch.zeros(B_, N, dtype=torch.bool)
    pad[1, -4:] = True
    P = ops.softmax_attention_weights(q, k, key_padding_mask=pad)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(pad[:, None, None, :], float("-inf"))
    torch.testing.assert_close(P, logits.softmax(-1), rtol=1e-12, atol=0)

    alpha = torch.tensor([1.0, 1.5, 2.0], dtype=F64).view(1, H_, 1, 1)
    L = ops.lln_attention_weights(q, k, alpha, 0.7, causal=True)
    scores = torch.exp(alpha * q) @ torch.exp(0.7 * k).transpose(-1, -2)  # LLN eq. 8-9
    scores = scores.tril()
    torch.testing.assert_close(L, scores / scores.sum(-1, keepdim=True), rtol=1e-12, atol=0)
    assert bool((L.triu(1) == 0).all())
    assert spectral_gap(L).shape == (B_, H_)

    rows = torch.tensor([0, 5, 12])
    torch.testing.assert_close(ops.lln_attention_weights(q, k, alpha, 0.7, causal=True, rows=rows),
                               L[:, :, rows], rtol=1e-12, atol=0)
    sampled = ops.softmax_attention_weights(q, k, rows=4)
    assert sampled.shape == (B_, H_, 4, N)
    torch.testing.assert_close(sampled, ops.softmax_attention_weights(q, k)[:, :, [0, 4, 8, 12]])
    assert entropy(sampled).shape == sparsity(sampled).shape == log_moments(sampled)[0].shape == (B_, H_)
    with pytest.raises(ValueError, match="square"):
        spectral_gap(sampled)


def test_lln_weights_are_exact_for_large_fp32_inputs():
    # exponents spread over ~±100: exp(alpha q)·exp(beta k) over- or underflows in fp32 if done naively
    g = _gen(7)
    q, k = (15 * torch.randn(1, 2, 40, 8, generator=g) for _ in range(2))
    P = ops.lln_attention_weights(q, k, 2.0, 2.0)
    log_features = torch.logsumexp(2.0 * q.double()[..., :, None, :] + 2.0 * k.double()[..., None, :, :], dim=-1)
    assert P.dtype == torch.float32
    torch.testing.assert_close(P, log_features.softmax(-1).float(), rtol=1e-5, atol=1e-7)


def test_lln_weights_handle_huge_offsets_exactly():
    # exp(alpha (q_i + c_i)) scales row i by a constant (cancels); exp(beta (k_j + c_j)) reweights
    # column j by exp(beta c_j). Offsets of hundreds overflow exp even in float64 without the shifts.
    g = _gen(8)
    q, k = (torch.randn(1, 2, 9, 4, generator=g, dtype=F64) for _ in range(2))
    P = ops.lln_attention_weights(q, k, 2.0, 1.5)
    row_offset = 400 * torch.rand(1, 2, 9, 1, generator=g, dtype=F64)
    torch.testing.assert_close(ops.lln_attention_weights(q + row_offset, k, 2.0, 1.5), P)
    key_offset = 400 * torch.rand(1, 2, 9, 1, generator=g, dtype=F64)
    expected = (P.log() + 1.5 * key_offset.transpose(-1, -2)).softmax(-1)
    torch.testing.assert_close(ops.lln_attention_weights(q, k + key_offset, 2.0, 1.5), expected)


def test_row_functions_reject_bad_arguments():
    q = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match="alpha"):
        ops.lln_attention_weights(q, q, 0.0, 1.0)
    with pytest.raises(ValueError, match="rows"):
        ops.softmax_attention_weights(q, q, rows=torch.tensor([6]))
    with pytest.raises(ValueError, match="rows"):
        ops.lln_attention_weights(q, q, 1.0, 1.0, rows=torch.tensor([6]))
    with pytest.raises(ValueError, match="key_padding_mask"):
        ops.lln_attention_weights(q, q, 1.0, 1.0, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="same length"):
        ops.lln_attention_weights(q, q[:, :, :5], 1.0, 1.0, causal=True)
    with pytest.raises(ValueError, match="mix"):
        ops.lln_diag_attention_weights(q, q, 1.0, 1.0, mix="learnable_ratio")


# ---------------------------------------------------------------- modules describe themselves

def _module(method, causal, gen, **opts):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(method, E, H, causal=causal,
                             config={"lln_chunk_size": 8, "lln_diag_block_size": 5, **opts})
    return module.double().eval()


@pytest.mark.parametrize("method, causal, side", [
    ("softmax", False, "left"), ("softmax", True, "right"), ("lln", False, "left"), ("lln", True, "right"),
    ("lln_diag", False, "right"), ("lln_diag", True, "left"),
])
def test_attention_rows_times_values_is_attend(method, causal, side, gen):
    module = _module(method, causal, gen)
    x = torch.randn(T, B, E, generator=gen, dtype=F64)
    pad = padding_mask(B, T, side, gen)
    q, k, v = (module._heads(proj(x)) for proj in (module.q_proj, module.k_proj, module.v_proj))
    P = module.attention_rows(q, k, key_padding_mask=pad)
    assert P.shape == (B, H, T, T) and not P.requires_grad
    out = module.attend(q, k, v, pad)
    real = ~pad[:, None, :, None].expand_as(out)
    torch.testing.assert_close((P @ v)[real], out[real], rtol=1e-5, atol=1e-7)
    rows = torch.tensor([0, 7, 22])
    torch.testing.assert_close(module.attention_rows(q, k, key_padding_mask=pad, rows=rows,
                                                     lln=module.lln_parameters(q, k, pad)),
                               P[:, :, rows], rtol=1e-12, atol=1e-14)


def test_modules_describe_their_rows():
    for method, cls in ATTENTION_CLASSES.items():
        assert METHODS_EXTRA[method].rows_note and METHODS_EXTRA[method].colour, method
        assert cls.is_kernel_method == (method in ("kernelized", "skyformer"))
    module = _module("softmax", False, torch.Generator().manual_seed(0))
    q = torch.randn(1, H, 4, E // H, dtype=F64)
    assert module.lln_parameters(q, q) is None
    with pytest.raises(NotImplementedError, match="not a kernel method"):
        module.kernel_rows(q, q)


def test_analysis_has_no_attention_method_dispatch():
    """The analysis packages only measure: no method-name switch and no attention formula (docs/design.md §8)."""
    files = sorted(path for package in ("linattn", "fairseq_linattn", "linattn_tools")
                   for path in (ROOT / package / "analysis").glob("*.py"))
    assert len(files) >= 8
    for path in files:
        text = path.read_text()
        assert not re.search(r"\.method\s*(==|!=|in\b|not in\b)", text), path.name
        assert not re.search(r"\bmethod\s*(==|!=)", text), path.name
        for name in ("lavo", "skyformer", "kernelized", "lln_diag"):
            assert not re.search(rf"[\"']{name}[\"']", text), (path.name, name)
        assert not re.search(r"\battention_matrix\(|\.softmax\(|torch\.exp\(|masked_fill\(", text), path.name

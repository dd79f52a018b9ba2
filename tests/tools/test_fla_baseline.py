"""The targets benchmark's baseline series, flash-linear-attention's chunked causal linear attention
(``linattn_tools.benchmark.fla_baseline``): fla runs on CUDA GPUs only, so here a stand-in for its
``chunk_linear_attn`` (the float64 formula in fla's layout) checks what our module hands it and makes of its output,
and the benchmark's records and table with and without the series."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from linattn_tools.benchmark import fla_baseline
from linattn_tools.benchmark.targets import render

CALLS = []


def stand_in(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None):
    """fla's documented contract: q, k (B, T, H, K), v (B, T, H, V) -> o (B, T, H, V) = (q S_t) / (q · z_t) when
    ``normalize``, S_t, z_t the sums of k_j v_jᵀ and k_j over j <= t; scores scaled by ``scale``."""
    CALLS.append(dict(shapes=(q.shape, k.shape, v.shape), scale=scale, normalize=normalize))
    s = torch.einsum("bthd,bshd->bhts", q.double(), k.double()).tril() * scale
    out = torch.einsum("bhts,bshe->bthe", s, v.double())
    if normalize:
        out = out / s.sum(-1).transpose(1, 2)[..., None]
    return out.to(q.dtype), None


@pytest.fixture
def fla(monkeypatch):
    """``fla.ops.linear_attn`` importable, its ``chunk_linear_attn`` the stand-in."""
    CALLS.clear()
    linear_attn = types.ModuleType("fla.ops.linear_attn")
    linear_attn.chunk_linear_attn = stand_in
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.linear_attn", linear_attn)):
        monkeypatch.setitem(sys.modules, name, module)
    return CALLS


def test_the_baseline_module_is_the_softmax_modules_projections_around_normalised_elu_features(fla):
    torch.manual_seed(0)
    module = fla_baseline.build_baseline(embed_dim=24, num_heads=3, dtype=torch.float64)
    t, b = 7, 2  # T != H != B: a transposition that mixes them fails
    x = torch.randn(t, b, 24, dtype=torch.float64)
    out, _ = module(x, x, x, need_weights=False)
    assert fla == [dict(shapes=(torch.Size([b, t, 3, 8]),) * 3, scale=1.0, normalize=True)]
    # by hand: the projections, (B, H, T, D) heads, elu + 1 features, causal sums, normalised (eq. 9)
    q, k, v = (proj(x).view(t, b, 3, 8).permute(1, 2, 0, 3) for proj in (module.q_proj, module.k_proj,
                                                                         module.v_proj))
    scores = torch.einsum("bhtd,bhsd->bhts", F.elu(q) + 1, F.elu(k) + 1).tril()
    heads = scores @ v / scores.sum(-1, keepdim=True)
    expected = module.out_proj(heads.permute(2, 0, 1, 3).reshape(t, b, 24))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.sum().backward()  # the step's backward reaches the projections
    assert module.q_proj.weight.grad is not None and module.v_proj.weight.grad is not None


def test_the_baseline_is_causal_and_unpadded_only(fla):
    module = fla_baseline.build_baseline(embed_dim=8, num_heads=2)
    x = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="fla_linear: the baseline is causal self-attention without a padding"):
        module(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), need_weights=False)


def test_fla_is_left_out_with_its_reason_off_a_gpu_or_where_it_does_not_import(fla, monkeypatch):
    assert "CUDA GPUs only, not on cpu" in fla_baseline.unavailable("cpu")
    assert fla_baseline.unavailable("cuda") is None  # the stand-in imports
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", None)  # an import that fails
    assert "does not import here (ModuleNotFoundError" in fla_baseline.unavailable("cuda")


def test_the_targets_table_has_the_baseline_row_against_causal_softmax():
    def row(method, causal, n, ms, impl):
        return {"method": method, "causal": causal, "n": n, "batch": 32768 // n, "dtype": "bfloat16", "impl": impl,
                "median_s": ms / 1e3, "peak_bytes": 2 ** 20}
    rows = [row("softmax", True, 2048, 4, "only"), row("softmax", True, 4096, 8, "only"),
            row("softmax", False, 4096, 2, "only"), row(fla_baseline.METHOD, True, 4096, 2, "fla-core 0.6.0")]
    text = render([{"machine": {"cpu": "x", "gpu": "H100", "torch": "2.11"}, "rows": rows}])
    assert "| fla_linear causal (baseline) | – | 0.25× `fla-core 0.6.0` | – |" in text
    assert "fla_linear" not in render([{"machine": {"cpu": "x", "torch": "2.11"}, "rows": rows[:3]}])

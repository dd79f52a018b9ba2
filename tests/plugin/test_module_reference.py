"""Every module's ``attend`` equals its ``reference`` (the op's materialised paper formula), for every method
and role the registry declares: the check the GPU self-test runs on a GPU."""
import pytest
import torch
from helpers import padding_mask, rel_err

from fairseq_linattn.modules import build_attention
from linattn.methods import METHODS

CASES = [(name, role) for name, m in METHODS.items() for role in m.roles]
CONFIG = dict(lln_chunk_size=4, lln_diag_block_size=5, lln_diag_mix="learnable_scale", lln_stats_per_head=True,
              lln_stats="ema", skyformer_landmarks=6, lavo_window=4, lavo_bases=3)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name,role", CASES)
def test_attend_equals_the_reference(name, role, side, gen):
    module = build_attention(name, 12, 3, causal=role == "decoder", cross=role == "cross", config=CONFIG).double()
    with torch.no_grad():  # parameters away from their symmetric initial values: a swapped one shows
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for b in module.buffers():
            b.mul_(1 + torch.rand(b.shape, generator=gen, dtype=b.dtype))  # LLN's EMA: alpha != beta per head
    module.eval()
    n = 13
    q = torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64)
    k = 2.0 * torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64)
    mask = padding_mask(2, n, side, gen)
    out = module.attend(q, k if module.uses_keys else None, v, mask)
    ref = module.reference(q, k, v, mask)
    real = ~mask
    assert rel_err(out.transpose(1, 2)[real], ref.transpose(1, 2)[real]) < 1e-10
    if name in ("lln", "lln_diag"):
        alpha, beta = module.lln_parameters(q, k, mask)["alpha"], module.lln_parameters(q, k, mask)["beta"]
        assert not torch.allclose(alpha, beta)

"""fairseq's --fp16 (a half module: inputs arrive in fp16/bf16) and --amp (autocast over an fp32 module) run every
method's training step in the parallel implementation without NaN or inf, and its output stays within the tolerance
table (linattn/tolerances.py) of the same module in float64."""
import copy

import pytest
import torch
from helpers import rel_err

from fairseq_linattn.modules.build import build_attention
from linattn.methods import methods_for
from linattn.tolerances import tolerance

CAUSAL = {"encoder": False, "decoder": True}
CASES = [(m, role) for role in CAUSAL for m in methods_for(role)]
SMALL = dict(lln_chunk_size=16, lln_diag_block_size=16, skyformer_landmarks=16, lavo_window=8)
SETTINGS = {"fp16": (torch.float16, False), "bf16": (torch.bfloat16, False), "amp-bf16": (torch.bfloat16, True),
            "amp-fp16": (torch.float16, True)}


def _inputs(gen, n=67, b=2, c=64):
    x = torch.randn(n, b, c, generator=gen, dtype=torch.float64)
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[1, n - 20:] = True
    return x, mask


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("method,role", CASES)
def test_half_training_step_is_finite_and_close_to_float64(gen, method, role, setting):
    dtype, amp = SETTINGS[setting]
    torch.manual_seed(0)
    exact = build_attention(method, 64, 4, causal=CAUSAL[role], config=dict(SMALL, attention_impl="parallel"))
    exact = exact.double().eval()  # eval: Skyformer's fixed landmarks, the matcher's running statistics
    half = copy.deepcopy(exact).to(torch.float32 if amp else dtype)
    x, mask = _inputs(gen)
    with torch.no_grad():
        want, _ = exact(x, x, x, key_padding_mask=mask, need_weights=False)
    xh = x.to(torch.float32 if amp else dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=amp):
        got, _ = half(xh, xh, xh, key_padding_mask=mask, need_weights=False)
    real = ~mask.t()[..., None].expand_as(want)
    assert got.dtype == dtype and torch.isfinite(got).all()  # under autocast: its dtype, from out_proj
    assert rel_err(got[real], want[real]) <= tolerance(method, str(dtype).split(".")[1])
    half.train()  # the training step: moment-matcher updates, landmark redraws, dropout paths
    with torch.autocast("cpu", dtype=dtype, enabled=amp):
        out, _ = half(xh, xh, xh, key_padding_mask=mask, need_weights=False)
    out.float().square().mean().backward()
    grads = [xh.grad] + [p.grad for p in half.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)

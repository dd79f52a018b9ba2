"""Non-causal LLN's products in half operands (``triton/lln_noncausal.py``'s ``_readout``,
``lln_noncausal_backward.py``'s ``_state_grad``), each bounded by a normalisation: the state's rows S / z less their
centre mu (|.| <= 2 max |v|, where S itself grows with the keys) read by the probabilities p = phi_q * z / den in
[0, 1]; and the output gradient as given (half) read by p, where go = grad / den shrinks as den grows. Cases where
the unnormalised operand would leave fp16's range (65504) or its normal numbers (6 * 10^-5): many keys with large
features and large values (S ~ N max |v|), small output gradients (go = grad / den ~ 10^-4 / N), padding on both
sides; against the float64 reference within ``linattn/tolerances.py``, under Triton's interpreter."""
import os

import pytest
import torch
from helpers import rel_err

from linattn import ops
from linattn.tolerances import tolerance

assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before anything imports Triton"

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (common.py)

DTYPES = [("float16", torch.float16), pytest.param("bfloat16", torch.bfloat16, marks=pytest.mark.extended)]
ALPHA = torch.tensor([1.3, 0.7]).view(1, 2, 1, 1)
BETA = 0.9
N, D, DV = 400, 20, 12


def both_sides_mask() -> torch.Tensor:
    """(2, N) bool: the second sequence padded on both sides."""
    mask = torch.zeros(2, N, dtype=torch.bool)
    mask[1, :37] = True
    mask[1, N - 50:] = True
    return mask


def grads(q, k, v, grad, dtype):
    """(out, dq, dk, dv) of the fused op at ``dtype`` and of the float64 reference, under dL/d(out) = grad."""
    mask = both_sides_mask()
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = ops.lln_attention(*leaves, ALPHA, BETA, causal=False, key_padding_mask=mask, impl="fused")
    got = torch.autograd.grad(out, leaves, grad.to(dtype))
    leaves = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    ref = ops.lln_attention_reference(*leaves, ALPHA, BETA, causal=False, key_padding_mask=mask)
    return (out, *got), (ref, *torch.autograd.grad(ref, leaves, grad.to(dtype).double()))


@pytest.mark.parametrize("name, dtype", DTYPES)
def test_readout_reads_the_state_normalised(gen, name, dtype):
    """Two groups of keys (alternate rows), features 0-9 near 0.8 for one and 10-19 for the other, values +-500:
    S ~ 200 * 0.8 * 500 ~ 74000 (over fp16's range), and so is S - mu z (the values' mean mu ~ 0); S / z ~ +-480.
    Queries lean to one group (3 rows each). The output and every gradient within the tolerances."""
    side = 1.0 - 2.0 * (torch.arange(N) % 2)  # a key's group: +1 or -1
    lean = 1.0 - 2.0 * (torch.arange(N) // 3 % 2)  # the group a query leans to
    q, k = (0.1 * torch.randn(2, 2, N, D, generator=gen) for _ in range(2))
    for t, sign, size in ((k, side, 2.0), (q, lean, 1.5)):
        t[..., :10] += size * sign[:, None]
        t[..., 10:] -= size * sign[:, None]
    v = 500 * side[:, None] + torch.randn(2, 2, N, DV, generator=gen)
    got, want = grads(q, k, v, torch.randn(2, 2, N, DV, generator=gen), dtype)
    assert rel_err(got[0], want[0]) < tolerance("lln", name)
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) < tolerance("lln", name, gradient=True)


@pytest.mark.parametrize("name, dtype", DTYPES)
def test_state_gradient_takes_the_probabilities(gen, name, dtype):
    """Output gradients ~ 10^-4 on 400 keys of features near 0.8: den = phi_q·z ~ 300, so go = grad / den ~ 3 * 10^-7
    would be an fp16 subnormal of 2 or 3 bits (its least normal 6 * 10^-5), where p = phi_q * z / den (in [0, 1]) and
    grad itself hold 11. A query feature dominates every row (alpha q_0 ~ 5 over the others' ~ 0.6). The output and
    dk and dv (through dL/d[S, z]) within the tolerances; dq, ~10^-5 here, rounds to fp16's subnormals whatever its
    products: finite."""
    q = 0.5 * torch.randn(2, 2, N, D, generator=gen)
    q[..., 0] += 4.0
    k = 0.1 * torch.randn(2, 2, N, D, generator=gen)
    v = torch.randn(2, 2, N, DV, generator=gen)
    got, want = grads(q, k, v, 1e-4 * torch.randn(2, 2, N, DV, generator=gen), dtype)
    assert rel_err(got[0], want[0]) < tolerance("lln", name)
    for g, w in zip(got[2:], want[2:]):
        assert rel_err(g, w) < tolerance("lln", name, gradient=True)
    assert got[1].isfinite().all()

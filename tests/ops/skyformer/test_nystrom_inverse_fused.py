"""Skyformer's M^-1 kernels (``linattn/ops/triton/nystrom_inverse.py``) run by Triton's interpreter: M^-1 by the
6-step iteration and dL/dL by the iteration's own derivative, against the same iteration in float64 (``skyformer/
inverse.py``'s ``inverse_forward`` and ``inverse_backward``, the parallel implementation's), within
``linattn/tolerances.py``'s float32 row: odd and tiny landmark counts, several row blocks and inner steps, unused
slots, no ridge, tied column sums; and one kernel each way."""
import json

import pytest
import torch
from helpers import rel_err

from linattn.ops.skyformer.inverse import inverse_backward, inverse_forward
from linattn.ops.skyformer.nystrom import _keep
from linattn.ops.triton.nystrom_inverse import nystrom_inverse, nystrom_inverse_backward
from linattn.tolerances import tolerance
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)


def landmarks(gen, b, h, num, d, unused=0.25):
    """L (B,H,num,D) fp32 as the op gathers them (rows of X scaled by D^(-1/4)), used slots (B,num) bool."""
    land = torch.randn(b, h, num, d, generator=gen) * d ** -0.25
    used = torch.rand(b, num, generator=gen) >= unused
    used[:, 0] = True
    return land, used


def check(gen, land, used, gamma):
    """The kernels' M^-1 and dL/dL against the float64 iteration's, for a random dL/dM^-1."""
    out, tape = nystrom_inverse(land, used.float(), gamma)
    grad = torch.randn(out.shape, generator=gen)
    want, saved = inverse_forward(land.double(), _keep(used, land.double())[1], gamma)
    assert out.dtype == torch.float32 and rel_err(out, want) < tolerance("skyformer", "float32")
    dland = nystrom_inverse_backward(land, used.float(), gamma, tape, grad)
    assert dland.shape == land.shape
    assert rel_err(dland, inverse_backward(saved, grad.double())) < tolerance("skyformer", "float32", gradient=True)


@pytest.mark.parametrize("num, d", [(2, 20), (6, 20), (17, 72)])
def test_the_kernels_give_the_float64_iteration_and_its_derivative(gen, num, d):
    """17 slots: one block of 32 of 17 rows; D = 72: the kernel rows' inner steps over a block of 128."""
    check(gen, *landmarks(gen, 2, 2, num, d), 0.1)


def test_one_landmark(gen):
    """M = 1 + gamma whatever L holds: M^-1 is the iteration's 1 / (1 + gamma) (exact after six steps to fp32's
    rounding) and dL/dL is 0."""
    land, used = landmarks(gen, 2, 2, 1, 20)
    out, tape = nystrom_inverse(land, used.float(), 0.25)
    assert torch.allclose(out, torch.full_like(out, 0.8), rtol=1e-6, atol=0)
    dland = nystrom_inverse_backward(land, used.float(), 0.25, tape, torch.randn(out.shape, generator=gen))
    assert dland.abs().max() < 1e-6


@pytest.mark.parametrize("gamma", [0.0, 0.1])
def test_launch_settings_several_row_blocks_inner_steps_and_tf32x3(gen, monkeypatch, gamma):
    """``LAUNCH``'s own settings (the GPU's; the interpreter's default takes whole matrices in exact fp32:
    ``common.INTERPRETED``): tf32x3 products (emulated), and 40 slots in blocks of 32 and 16 rows, inner steps of
    16, the last partial; gamma = 0 (no ridge: kappa(L, L)'s diagonal alone keeps M's row sums positive)."""
    from linattn.ops.triton.common import LAUNCH
    monkeypatch.setenv("LINATTN_TRITON_LAUNCH", json.dumps({k: LAUNCH[k] for k in ("nystrom_inverse",
                                                                                   "nystrom_inverse_grad")}))
    assert 40 > LAUNCH["nystrom_inverse"]["BLOCK"] > LAUNCH["nystrom_inverse_grad"]["BLOCK"] == 16
    check(gen, *landmarks(gen, 1, 1, 40, 20), gamma)


def test_an_unconverged_iteration(gen):
    """Twelve close landmarks and gamma = 0.001: M is ill-conditioned and six steps leave ||I - M M^-1|| at about
    0.6, so the result depends on the scaling S and on Z_0's c, which a converged iteration forgets (the gradients
    through s and c are then about 0, and a wrong one passes the other tests)."""
    base = torch.randn(1, 1, 1, 20, generator=gen) * 20 ** -0.25
    land = base + 0.2 * torch.randn(1, 2, 12, 20, generator=gen)
    check(gen, land, torch.ones(1, 12, dtype=torch.bool), 0.001)


def test_tied_column_sums_give_the_float64_gradient(gen):
    """Two landmarks a e_1 and a e_2: M's two rows hold the same two numbers, so A's column sums tie exactly (in
    fp32 and float64) and c = max(column sums) is attained twice; the kernel finds its columns (no 0 / 0 where none
    is found) and gives the float64 gradient. (Here A's column sums are 1 whatever a is, so how dL/dc is shared
    between the tied columns does not show in dL/dL.) a = 0.1 and no ridge: an unconverged iteration, whose
    result depends on c."""
    land = torch.zeros(1, 1, 2, 8)
    land[0, 0, 0, 0] = land[0, 0, 1, 1] = 0.1
    check(gen, land, torch.ones(1, 2, dtype=torch.bool), 0.0)


def test_every_slot_unused_but_the_first_is_an_identity_block(gen):
    """Unused slots are inert: M restricted to them is (1 + gamma) I, nothing couples them to the used slot (M^-1's
    entries between them 0), and their landmarks get no gradient but rounding's (kappa(l, l) = 1 whatever l)."""
    land, used = landmarks(gen, 1, 2, 5, 20, unused=1.0)
    out, tape = nystrom_inverse(land, used.float(), 0.1)
    assert torch.equal(out[..., 0, 1:], torch.zeros_like(out[..., 0, 1:]))
    assert torch.allclose(out.diagonal(dim1=-2, dim2=-1), torch.full((1, 2, 5), 1 / 1.1), rtol=1e-6, atol=0)
    dland = nystrom_inverse_backward(land, used.float(), 0.1, tape, torch.randn(out.shape, generator=gen))
    assert dland.abs().max() < 1e-5


def test_one_kernel_each_way(gen):
    land, used = landmarks(gen, 1, 2, 6, 20)
    with count_dispatch() as counted:
        out, tape = nystrom_inverse(land, used.float(), 0.1)
        nystrom_inverse_backward(land, used.float(), 0.1, tape, torch.ones_like(out))
    assert counted.ops["nystrom_inverse"] == 1 and counted.ops["nystrom_inverse_backward"] == 1
    assert tape.shape == (1, 2, 7, 6, 6)

import os

import pytest
import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def padding_mask(batch: int, n: int, side: str, generator=None) -> torch.Tensor:
    """(B, N) bool, True = padding; row 0 unpadded, the others padded on `side` by random amounts < N."""
    mask = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(1, batch):
        p = int(torch.randint(1, max(n, 2), (1,), generator=generator)) if n > 1 else 0
        if side == "left":
            mask[b, :p] = True
        else:
            mask[b, n - p:] = True
    return mask


@pytest.fixture
def gen():
    """A generator with a fresh seed each run (printed, so a failure can be replayed)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed())))
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def mc_gen():
    """A fixed seed for Monte-Carlo tests, whose tolerances are statistical: a fresh seed would make them
    fail now and then by chance (exactness tests use ``gen``, a fresh seed every run)."""
    return torch.Generator().manual_seed(20261123)


def fairseq_layout(*tensors: torch.Tensor):
    """(B,H,T,D) tensors laid out as fairseq's (T,B,H,D) projections seen as (B,H,T,D): no row is contiguous."""
    return tuple(t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in tensors)


def assert_same_values_and_grads(out, ref, inputs, generator, rtol=1e-8, atol=1e-9) -> None:
    """out == ref (float64 tolerances), and so are their gradients w.r.t. ``inputs`` for one random output grad."""
    torch.testing.assert_close(out, ref, rtol=rtol * 0.1, atol=atol * 0.1)
    g = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# -- uninitialised memory: ``--fill-uninitialized`` (or LINATTN_FILL_UNINITIALIZED=1) turns on, for the whole
# session, torch's deterministic mode with ``fill_uninitialized_memory``: every tensor made by ``empty`` /
# ``new_empty`` starts as NaN (integers: their largest value), so a read of a buffer no op has written shows
# as a NaN output or gradient (tests/test_uninitialized_memory.py runs the op tests this way).
FILL_ENV = "LINATTN_FILL_UNINITIALIZED"


def pytest_addoption(parser):
    parser.addoption("--fill-uninitialized", action="store_true", default=False,
                     help="torch.use_deterministic_algorithms(True) with fill_uninitialized_memory: new empty "
                          f"tensors hold NaN (also set by {FILL_ENV}=1)")


def pytest_configure(config):
    if config.getoption("--fill-uninitialized") or os.environ.get(FILL_ENV) == "1":
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True

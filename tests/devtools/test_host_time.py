"""The host-time benchmark (``dev.perf.host_time``): every series measured with its kernels' launches
stubbed, and the stub gone afterwards."""
import pytest
import torch

from dev.perf import host_time
from linattn import ops

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)


def test_every_series_is_timed_with_its_launches_stubbed_and_counted():
    rows = host_time.measure("fused", rounds=1, steps=2)
    assert [(r["method"], r["causal"]) for r in rows] == host_time.series()
    for r in rows:
        linear = r["method"] != host_time.BASELINE
        assert r["impl"] == ("fused" if linear else "only") and r["host_s"] > 0 and r["ops"] > 0
        assert (r["triton_launches"] > 0) == linear, r


def test_the_kernels_run_again_after_the_stub(gen):
    """A stub left in place would make every later fused op return unwritten memory."""
    q, k = (torch.randn(1, 2, 5, 8, generator=gen).half() for _ in range(2))
    with host_time.stub_launches() as counts:
        ops.token_moments(q, k, impl="fused")
    assert counts["launches"] == 1
    rows = ops.token_moments(q, k, impl="fused")
    torch.testing.assert_close(rows[0].double(), q.double().sum(-1), rtol=1e-6, atol=1e-5)
    assert counts["launches"] == 1

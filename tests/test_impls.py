"""The implementation an op's ``impl`` selects (linattn/ops/impls.py): auto = looped on the CPU, parallel on any
other device; a wrong name is refused with the allowed ones."""
import pytest
import torch

from linattn import ops
from linattn.ops.impls import auto_impl, resolve_impl


@pytest.mark.parametrize("device, want", [("cpu", "looped"), ("meta", "parallel"), ("cuda", "parallel")])
def test_auto_is_looped_on_the_cpu_and_parallel_elsewhere(device, want):
    assert resolve_impl("auto", torch.device(device)) == want
    assert resolve_impl("parallel", torch.device(device)) == "parallel"
    assert resolve_impl("looped", torch.device(device)) == "looped"
    with auto_impl("parallel" if want == "looped" else "looped"):
        assert resolve_impl("auto", torch.device(device)) != want
    assert resolve_impl("auto", torch.device(device)) == want


def test_an_unknown_impl_names_the_allowed_ones():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="impl must be one of auto, parallel, looped, got 'gpu'"):
        ops.lln_attention(q, q, q, 1.0, 1.0, impl="gpu")
    with pytest.raises(ValueError, match="impl must be one of parallel, looped, got .auto."):
        with auto_impl("auto"):
            pass

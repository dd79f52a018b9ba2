"""The implementation an op's ``impl`` selects (linattn/ops/impls.py): auto = looped on the CPU, parallel elsewhere
and under torch.compile (never fused until it is measured ahead of parallel in both causalities); fused where the
method has it and Triton imports, else parallel, and ``implementation_for`` says so; a wrong name is refused with the
allowed ones."""
import pytest
import torch

from linattn import ops
from linattn.ops import impls
from linattn.ops.impls import auto_impl, implementation_for, resolve_impl
from linattn.ops.lln.autograd import IMPLEMENTATIONS as LLN

WITH_FUSED = ("parallel", "looped", "fused")


@pytest.mark.parametrize("device, want", [("cpu", "looped"), ("meta", "parallel"), ("cuda", "parallel")])
def test_auto_is_looped_on_the_cpu_and_parallel_elsewhere(device, want):
    assert resolve_impl("auto", torch.device(device)) == want
    assert resolve_impl("parallel", torch.device(device)) == "parallel"
    assert resolve_impl("looped", torch.device(device)) == "looped"
    with auto_impl("parallel" if want == "looped" else "looped"):
        assert resolve_impl("auto", torch.device(device)) != want
    assert resolve_impl("auto", torch.device(device)) == want


@pytest.mark.parametrize("triton", [True, False])
def test_fused_runs_where_asked_for_the_method_has_it_and_triton_imports(monkeypatch, triton):
    monkeypatch.setattr(impls, "triton_available", lambda: triton)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    assert resolve_impl("fused", cuda, available=WITH_FUSED) == ("fused" if triton else "parallel")
    assert resolve_impl("auto", cuda, available=WITH_FUSED) == "parallel"  # not before a GPU run has verified it
    assert resolve_impl("fused", cuda) == "parallel"  # a method without fused.py
    assert resolve_impl("auto", torch.device("cpu"), available=WITH_FUSED) == "looped"
    assert resolve_impl("fused", torch.device("cpu"), available=WITH_FUSED) == "parallel"  # no interpreter
    with auto_impl("fused"):
        assert resolve_impl("auto", torch.device("cpu"), available=WITH_FUSED) == "parallel"


def test_auto_is_parallel_under_torch_compile(monkeypatch):
    """The looped implementation's Python loops would be unrolled into the graph (Inductor fails on causal LLN's)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_impl("auto", torch.device("cpu")) == "parallel"
    assert resolve_impl("looped", torch.device("cpu")) == "looped"  # asked for: --attention-compile refuses it


def test_implementation_for_names_the_fallback_of_fused(monkeypatch):
    monkeypatch.setattr(impls, "triton_available", lambda: True)
    half = torch.empty(1, 1, 4, 64, dtype=torch.float16, device="meta")
    assert implementation_for(LLN, "fused", half) == "fused"
    assert implementation_for("lln", "fused", half) == "fused"
    assert implementation_for("lln", "fused", half.float()) == "parallel"  # fp32: the kernels take half only
    assert implementation_for("lln", "fused", half.new_empty(1, 1, 4, 256)) == "parallel"  # D > 128
    assert implementation_for("lln", "fused", half, chunk=256) == "parallel"  # C×C held in registers: C <= 128
    assert implementation_for("lln", "fused", half, half.new_empty(1, 1, 4, 8, dtype=torch.bfloat16)) == "parallel"
    assert implementation_for("kernelized", "fused", half) == "parallel"  # no kernelized/fused.py
    assert implementation_for("lavo", "fused", half) == "fused" != implementation_for("lavo", "fused", half, window=128)
    assert implementation_for("lln_diag", "fused", half) == "fused"  # both parts' kernels take it
    assert implementation_for("lln_diag", "fused", half, chunk=256) == "parallel"  # LLN's kernels do not
    assert implementation_for("lln_diag", "fused", half, block=256) == "parallel"  # the block softmax's do not
    assert implementation_for("block_softmax", "fused", half, block=128) == "fused"
    assert implementation_for("block_softmax", "fused", half.float()) == "parallel"
    huge = half.new_empty(1, 16, 2**20, 128)  # 2^31 elements: past the kernels' int32 indices
    assert implementation_for("lln", "fused", huge) == "parallel" == implementation_for("block_softmax", "fused", huge)
    long = half.new_empty(1, 16, 2**18, 128)  # 2^29 elements; chunk states of 16 rows: 2^29 * 129 / 16 > 2^31
    assert implementation_for("lln", "fused", long) == "fused" != implementation_for("lln", "fused", long, chunk=16)
    assert implementation_for("softmax", "fused", half) == "only"  # SDPA: one implementation
    assert implementation_for("lln", "auto", torch.empty(1, 1, 4, 64, dtype=torch.float16)) == "looped"


def test_an_unknown_impl_names_the_allowed_ones():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="impl must be one of auto, parallel, looped, fused, got 'gpu'"):
        ops.lln_attention(q, q, q, 1.0, 1.0, impl="gpu")
    with pytest.raises(ValueError, match="impl must be one of parallel, looped, fused, got .auto."):
        with auto_impl("auto"):
            pass


def test_fused_asked_of_any_method_on_the_cpu_runs_parallel_and_matches():
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    for op in (lambda impl: ops.lln_attention(q, q, q, 1.0, 1.0, causal=True, impl=impl),
               lambda impl: ops.lln_diag_attention(q, q, q, 1.0, 1.0, block_size=4, impl=impl),
               lambda impl: ops.kernelized_attention(q, q, q, impl=impl)):
        torch.testing.assert_close(op("fused"), op("parallel"), rtol=0, atol=0)


ALL_FUSED = {"lln", "lln_diag", "skyformer", "lavo", "block_softmax"}


@pytest.mark.parametrize("kib, at_64, at_128", [(227, ALL_FUSED, ALL_FUSED),
                                                (163, ALL_FUSED, {"lavo", "block_softmax"}),
                                                (99, ALL_FUSED - {"skyformer"}, {"block_softmax"})])
def test_fused_runs_only_where_its_kernels_fit_the_devices_shared_memory(monkeypatch, kib, at_64, at_128):
    """An H100 gives a block 227 KiB, an A100 163, consumer GPUs about 99: at D = 64 the Nyström backward needs
    152 KiB, the others at most 80; at D = 128 the causal LLN backward needs 224 and the Nyström backward 216 (only
    an H100 has them), LAVO 160, the block softmax 96."""
    monkeypatch.setattr(impls, "triton_available", lambda: True)
    monkeypatch.setattr(impls, "device_shared_memory", lambda device: kib * 1024)
    for d, expected in ((64, at_64), (128, at_128)):
        half = torch.empty(1, 1, 4, d, dtype=torch.float16, device="meta")
        assert {m for m in ALL_FUSED if implementation_for(m, "fused", half) == "fused"} == expected, d

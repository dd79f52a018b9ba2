"""The implementation an op's ``impl`` selects (linattn/ops/impls.py): auto = looped on the CPU, parallel elsewhere
and under torch.compile (never fused until it is measured ahead of parallel in both causalities); fused where the
method has it (else parallel), and refused with its reasons where its kernels cannot take the call (dtype, Triton,
device, head size, the method's options, shared memory), never replaced; a wrong name is refused with the allowed
ones."""
import pytest
import torch

from linattn import ops
from linattn.ops import impls
from linattn.ops.impls import (
    ImplementationError,
    auto_impl,
    choose,
    declares,
    implementation_for,
    resolve_impl,
    table_of,
    unsupported_reasons,
)
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


def test_choose_says_why():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose("auto", cpu) == ("looped", "auto on cpu")
    assert choose("auto", cuda, WITH_FUSED) == ("parallel", "auto on cuda")  # not fused before a GPU run verified it
    assert choose("auto", cpu, compiling=True) == ("parallel", "auto under torch.compile")
    assert choose("fused", cuda, WITH_FUSED) == ("fused", "asked for")
    assert choose("fused", cuda) == ("parallel", "asked for: the method has no 'fused' implementation")
    with auto_impl("fused"):
        assert choose("auto", cpu) == ("parallel", "auto set by auto_impl: the method has no 'fused' implementation")
        assert choose("auto", cpu, WITH_FUSED) == ("fused", "auto set by auto_impl")


def test_auto_is_parallel_under_torch_compile(monkeypatch):
    """The looped implementation's Python loops would be unrolled into the graph (Inductor fails on causal LLN's)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_impl("auto", torch.device("cpu")) == "parallel"
    assert resolve_impl("looped", torch.device("cpu")) == "looped"  # asked for: --attention-compile refuses it


def refused(*args, **options) -> str:
    """The reasons ``implementation_for`` refuses a call with, joined."""
    with pytest.raises(ImplementationError) as err:
        implementation_for(*args, **options)
    assert str(err.value).endswith("; impl auto, parallel or looped run any call")
    return "; ".join(err.value.reasons)


def test_fused_runs_where_its_kernels_take_the_call_and_is_refused_elsewhere_with_the_reasons(monkeypatch):
    monkeypatch.setattr(impls, "triton_available", lambda: True)
    half = torch.empty(1, 1, 4, 64, dtype=torch.float16, device="meta")
    assert implementation_for(LLN, "fused", half) == "fused"
    assert implementation_for("lln", "fused", half) == "fused"
    assert refused("lln", "fused", half.float()) == "dtype torch.float32 not in (float16, bfloat16)"
    assert refused("lln", "fused", half.new_empty(1, 1, 4, 256)) == "head dim 256 > 128 (held in registers)"
    assert implementation_for("lln", "fused", half, chunk=256) == "fused"  # non-causal: no chunks
    assert refused("lln", "fused", half, causal=True, chunk=256) == ("causal chunk 256 > 128 (its C×C products are "
                                                                     "held in registers)")
    bf16 = half.new_empty(1, 1, 4, 8, dtype=torch.bfloat16)
    assert refused("lln", "fused", half, bf16) == "values' dtype torch.bfloat16 is not the queries' torch.float16"
    assert implementation_for("kernelized", "fused", half) == "parallel"  # no kernelized/fused.py: nothing refused
    assert implementation_for("lavo", "fused", half, causal=True) == "fused"
    assert refused("lavo", "fused", half, window=128) == "window 128 > 64 (its scores are held in registers)"
    assert refused("lavo", "fused", half, bases_dtype=torch.float32) == ("bases' dtype torch.float32 is not the "
                                                                         "queries' torch.float16")
    assert implementation_for("lln_diag", "fused", half) == "fused"  # both parts' kernels take it
    assert refused("lln_diag", "fused", half, causal=True, chunk=256).startswith("causal chunk 256")  # LLN's: not
    assert refused("lln_diag", "fused", half, block=256).startswith("block 256 > 128")  # the block softmax's: not
    assert refused("lln_diag", "fused", half.float()) == "dtype torch.float32 not in (float16, bfloat16)"  # once
    assert implementation_for("block_softmax", "fused", half, block=128) == "fused"
    assert refused("skyformer", "fused", half, causal=True) == "causal: the kernels run non-causal attention only"
    huge = half.new_empty(1, 16, 2**20, 128)  # 2^31 elements: past the kernels' int32 indices
    assert refused("lln", "fused", huge, half) == f"{2**31} elements in q > {2**31 - 1} (int32 indices)"
    assert refused("block_softmax", "fused", huge).startswith(f"{2**31} elements in q")
    long = half.new_empty(1, 16, 2**18, 128)  # 2^29 elements; chunk states of 16 rows: 2^29 * 129 / 16 > 2^31
    assert implementation_for("lln", "fused", long, causal=True) == "fused"
    assert "elements in the causal chunk states" in refused("lln", "fused", long, causal=True, chunk=16)
    assert implementation_for("softmax", "fused", half) == "only"  # SDPA: one implementation
    assert implementation_for("lln", "auto", torch.empty(1, 1, 4, 64, dtype=torch.float16)) == "looped"
    with auto_impl("fused"):  # auto chooses: inputs the kernels do not take run parallel
        assert implementation_for("lln", "auto", half.float()) == "parallel"
        assert implementation_for("lln", "auto", half) == "fused"
        q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
        torch.testing.assert_close(ops.lln_attention(q, q, q, 1.0, 1.0, causal=True, impl="auto"),
                                   ops.lln_attention(q, q, q, 1.0, 1.0, causal=True, impl="parallel"))


def test_the_reasons_name_a_missing_triton_and_a_device_the_kernels_do_not_run_on(monkeypatch):
    half = torch.empty(1, 1, 4, 64, dtype=torch.float16)
    assert unsupported_reasons("lln", "fused", half) == []  # the CPU under Triton's interpreter (tests/conftest.py)
    monkeypatch.delenv("TRITON_INTERPRET")
    cpu = "device cpu: the fused kernels run on cuda (cpu only under TRITON_INTERPRET=1)"
    assert unsupported_reasons("lln", "fused", half) == [cpu]
    assert unsupported_reasons("lln", "fused", half.to("meta")) == []  # the fake kernels
    assert unsupported_reasons("lln", "fused", half.to("meta"), device=torch.device("cpu")) == [cpu]  # a stand-in
    monkeypatch.setattr(impls, "triton_available", lambda: False)
    assert unsupported_reasons("lln", "fused", half.float()) == [
        "dtype torch.float32 not in (float16, bfloat16)", "Triton is not installed", cpu]
    assert unsupported_reasons("lln", "parallel", half) == unsupported_reasons("kernelized", "fused", half) == []
    with pytest.raises(ImplementationError, match="Triton is not installed"):
        ops.lln_attention(half, half, half, 1.0, 1.0, impl="fused")


def test_a_call_is_worked_out_once_and_again_where_what_the_reasons_read_changes(monkeypatch):
    """A forward asks two or three times (the moment matcher, its rows, the op): ``implementation_for`` works a
    call's shapes and options out once, and again when what the reasons read changes (TRITON_INTERPRET, Triton,
    the device's shared memory, ``auto_impl``); nothing is kept under torch.compile."""
    from linattn.ops.lln import fused as lln_fused

    calls = []
    original = lln_fused.not_supported_reasons
    monkeypatch.setattr(lln_fused, "not_supported_reasons", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    monkeypatch.setattr(impls, "_DECISIONS", {})
    half = torch.empty(1, 2, 8, 16, dtype=torch.float16)
    for _ in range(3):
        assert implementation_for(LLN, "fused", half, causal=True, chunk=8) == "fused"
    assert len(calls) == 1
    assert implementation_for(LLN, "fused", half, causal=True, chunk=4) == "fused"  # other options
    assert implementation_for(LLN, "fused", half[:, :1], causal=True, chunk=8) == "fused"  # another shape
    assert len(calls) == 3
    assert refused(LLN, "fused", half, half[..., :4].float()) == "values' dtype torch.float32 is not the queries' " \
                                                                   "torch.float16"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "device cpu" in refused(LLN, "fused", half, causal=True, chunk=8)
    with auto_impl("fused"):
        assert implementation_for(LLN, "auto", half, causal=True, chunk=8) == "parallel"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert implementation_for(LLN, "auto", half, causal=True, chunk=8) == "looped"
    with auto_impl("fused"):
        assert implementation_for(LLN, "auto", half, causal=True, chunk=8) == "fused"
    monkeypatch.setattr(impls, "triton_available", lambda: False)
    assert refused(LLN, "fused", half, causal=True, chunk=8) == "Triton is not installed"
    monkeypatch.setattr(impls, "triton_available", lambda: True)
    wide = half.new_empty(1, 2, 8, 128)
    assert implementation_for(LLN, "fused", wide, causal=True, chunk=8) == "fused"
    monkeypatch.setattr(impls, "device_shared_memory", lambda device: 64 * 1024)
    assert refused(LLN, "fused", wide, causal=True, chunk=8) == (
        "head dim 128 needs 224 KiB of shared memory a block, cpu gives 64")
    assert len(calls) == 10  # each change above worked out anew (auto: looped, nothing to ask)
    monkeypatch.undo()
    monkeypatch.setattr(lln_fused, "not_supported_reasons", lambda *a, **kw: calls.append(a) or original(*a, **kw))
    monkeypatch.setattr(impls, "_DECISIONS", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls.clear()
    for _ in range(2):
        assert implementation_for(LLN, "fused", half, causal=True, chunk=8) == "fused"
    assert impls._DECISIONS == {} and len(calls) == 2


def test_an_unknown_impl_names_the_allowed_ones():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="impl must be one of auto, parallel, looped, fused, got 'gpu'"):
        ops.lln_attention(q, q, q, 1.0, 1.0, impl="gpu")
    with pytest.raises(ValueError, match="impl must be one of parallel, looped, fused, got .auto."):
        with auto_impl("auto"):
            pass


def test_fused_asked_of_inputs_its_kernels_do_not_take_is_refused_by_every_op_with_its_reasons():
    """float64 inputs: each op with a fused implementation says why it cannot run it (never runs parallel in its
    place); kernelized, which has none, runs parallel."""
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    bases, bias = ops.lavo_init_bases(2, 4, 4).double(), torch.zeros(2, 7, dtype=torch.float64)
    calls = {"lln": lambda impl: ops.lln_attention(q, q, q, 1.0, 1.0, causal=True, impl=impl),
             "lln_diag": lambda impl: ops.lln_diag_attention(q, q, q, 1.0, 1.0, block_size=4, impl=impl),
             "block_softmax": lambda impl: ops.block_softmax_attention(q, q, q, block_size=4, impl=impl),
             "skyformer": lambda impl: ops.skyformer_attention(q, q, q, num_landmarks=4, training=False, impl=impl),
             "lavo": lambda impl: ops.lavo_attention(q, q, q, bases, bias, window=4, impl=impl),
             "token_moments": lambda impl: ops.token_moments(q, q, impl=impl)}
    for name, call in calls.items():
        call("parallel")
        with pytest.raises(ImplementationError, match=r"dtype torch.float64 not in \(float16, bfloat16\)"):
            call("fused")
    torch.testing.assert_close(ops.kernelized_attention(q, q, q, impl="fused"),
                               ops.kernelized_attention(q, q, q, impl="parallel"), rtol=0, atol=0)


def test_implementations_declare_what_they_do_differently_in_their_own_file():
    """The block softmax's and LAVO's kernels read the rows through the real-first order; LLN's fused file has the
    moment matcher's kernels; the base implementations declare nothing."""
    for method in ("block_softmax", "lavo"):
        table = table_of(method)
        assert [impl for impl in table if declares(table, impl, "READS_REAL_FIRST")] == ["fused"], method
    assert [impl for impl, module in LLN.items() if hasattr(module, "token_moments")] == ["fused"]
    assert not declares(table_of("lln_diag"), "parallel", "READS_REAL_FIRST")  # its base entries are None


ALL_FUSED = {"lln", "lln_diag", "skyformer", "lavo", "block_softmax"}


@pytest.mark.parametrize("kib, at_64, at_128", [(227, ALL_FUSED, ALL_FUSED),
                                                (163, ALL_FUSED, {"lavo", "block_softmax", "skyformer"}),
                                                (99, ALL_FUSED, {"block_softmax", "skyformer"})])
def test_fused_runs_only_where_its_kernels_fit_the_devices_shared_memory(monkeypatch, kib, at_64, at_128):
    """An H100 gives a block 227 KiB, an A100 163, consumer GPUs about 99: at D = 64 the Nyström backward needs
    90 KiB, the others at most 80; at D = 128 the causal LLN backward needs 224 (only an H100 has it), LAVO 160,
    the block softmax and Skyformer 96 (Skyformer's forward ``_readout`` as built for an A100)."""
    monkeypatch.setattr(impls, "triton_available", lambda: True)
    monkeypatch.setattr(impls, "device_shared_memory", lambda device: kib * 1024)
    for d, expected in ((64, at_64), (128, at_128)):
        half = torch.empty(1, 1, 4, d, dtype=torch.float16, device="meta")
        assert {m for m in ALL_FUSED if not unsupported_reasons(m, "fused", half)} == expected, d
    if kib == 163:
        assert unsupported_reasons("lln", "fused", half) == [
            "head dim 128 needs 224 KiB of shared memory a block, meta gives 163"]
        # a stand-in q for a device not placed yet: its GPU, and so its shared memory, is not known
        assert unsupported_reasons("lln", "fused", half, device=torch.device("cuda")) == []


def test_every_fused_file_declares_what_it_takes_and_the_options_list_every_implementation():
    from dataclasses import fields

    from linattn.config import AttentionConfig
    from linattn.methods import METHODS

    tables = {m: table_of(m) for m in (*METHODS, "block_softmax")}
    fused = {m: t["fused"] for m, t in tables.items() if t is not None and "fused" in t}
    assert set(fused) == ALL_FUSED
    for method, module in fused.items():
        assert callable(module.not_supported_reasons), method
        assert method == "lln_diag" or isinstance(module.SUPPORT, impls.Support), method  # LLN+Diag: its parts'
    choices = next(f for f in fields(AttentionConfig) if f.name == "attention_impl").metadata["choices"]
    assert choices is impls.IMPLS

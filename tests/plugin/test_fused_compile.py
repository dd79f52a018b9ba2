"""--attention-compile over the fused implementation (Triton's interpreter on CPU tensors, Inductor's C++ around
it): a module whose q, k, v come from its packed projection compiles, and its first compiled training step matches
eager. The fused backward ops once packed dq, dk, dv into one tensor wherever q, k, v were packed siblings; Inductor
works an op's outputs out again from inputs with storages of their own, so under ``torch.compile`` the op's outputs
changed shape between tracing and lowering and every fused method failed to compile (``packed_heads.packs_grads``)."""
import pytest
import torch
import torch._dynamo

from fairseq_linattn.modules.build import build_attention
from linattn.ops.packed_heads import packed_siblings, packs_grads, split_heads
from linattn.ops.triton.common import inputs_in_layout, new_grads, op_grads
from linattn_tools.recipes.selftest.compiled import training_step

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (ops/triton/common.py)

SMALL = dict(lln_chunk_size=8, lln_diag_block_size=8, skyformer_landmarks=8, lavo_window=4)
EXTENDED = pytest.mark.extended  # a compile each, 1-12 s on 2 cores


# one case an op family's backward in the default tier (each fused.py decides its own pack); the twins extended
@pytest.mark.parametrize("method,causal", [("lln", True), ("lln", False), ("lln_diag", False), ("skyformer", False),
                                          ("lavo", True), *(pytest.param(*c, marks=EXTENDED) for c in (
                                              ("lln_diag", True), ("lavo", False)))])
def test_compiled_fused_module_step_matches_eager(gen, caplog, method, causal):
    """The module's own first-step check (compiled against eager, the tolerance table's fp16 entry) passes and says
    so, and a second compiled step equals an eager fused module's with the same weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = dict(SMALL, attention_impl="fused", attention_compile=True, attention_compile_check="first-step")
    compiled = build_attention(method, 32, 2, causal=causal, config=config).half()
    eager = build_attention(method, 32, 2, causal=causal, config=dict(config, attention_compile=False)).half()
    eager.load_state_dict(compiled.state_dict())
    x = torch.randn(19, 2, 32, generator=gen).half()
    mask = torch.zeros(2, 19, dtype=torch.bool)
    mask[1, :5] = True  # left padding
    with caplog.at_level("INFO", logger="fairseq_linattn.modules.compile_check"):
        training_step(compiled, x, mask, seed=1)
    assert sum("first compiled training step matches eager" in r.message for r in caplog.records) == 1
    training_step(eager, x, mask, seed=1)  # the same moment-matcher state as the compiled module's
    (out_c, gx_c, gp_c), (out_e, gx_e, gp_e) = (training_step(m, x, mask, seed=2) for m in (compiled, eager))
    torch.testing.assert_close(out_c, out_e, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(gx_c, gx_e, rtol=2e-3, atol=2e-3)
    assert len(gp_c) == len(gp_e) > 0
    for a, b in zip(gp_c, gp_e):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_gradients_are_packed_only_for_siblings_outside_compile(monkeypatch):
    """``packs_grads``: the module's packed q, k, v in eager mode only. A backward op's outputs follow its ``pack``
    alone (``new_grads``), the same for siblings and for tensors of their own; asked to pack apart tensors, it reads
    one packed copy of them (``inputs_in_layout``), which its packed gradients' strides fit."""
    q, k, v = split_heads(torch.randn(7, 2, 3, 3, 4, dtype=torch.float16))
    apart = [t.contiguous() for t in (q, k, v)]
    assert packed_siblings(q, k, v) and packs_grads(q, k, v) and not packs_grads(*apart)
    for inputs in ((q, k, v), apart):
        assert [tuple(t.shape) for t in op_grads(*new_grads(*inputs, True))] == [(0,)] * 3 + [(2, 3, 7, 12)]
        assert [tuple(t.shape) for t in op_grads(*new_grads(*inputs, False))] == [(2, 3, 7, 4)] * 3 + [(0,)]
    fairseq, sqk, sv, read = inputs_in_layout(*apart, pack=True)
    assert fairseq and sqk == sv == 12 and packed_siblings(*read)
    assert all(torch.equal(r, t) for r, t in zip(read, apart))
    _, sqk, sv, read = inputs_in_layout(q, k, v, pack=False)
    assert sqk == sv == 4 and not packed_siblings(*read) and all(torch.equal(r, t) for r, t in zip(read, (q, k, v)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not packs_grads(q, k, v)

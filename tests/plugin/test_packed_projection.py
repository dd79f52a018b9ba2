"""Self-attention projects q, k, v in one matmul (``AttentionBase._packed_heads``): the same values as three, and a
fused backward's gradients go back into the packed tensor without a copy (``linattn.ops.packed_heads``)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_linattn.modules.build import build_attention
from linattn.methods import methods_for

CAUSAL = {"encoder": False, "decoder": True}
CASES = [(m, role) for role in CAUSAL for m in methods_for(role)]
SMALL = dict(lln_chunk_size=8, lln_diag_block_size=8, skyformer_landmarks=8, lavo_window=4)


class Calls(TorchDispatchMode):
    """The ATen ops run, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def run(module, x, key, value, mask, grad):
    """Output, x's gradient (through query, key and value) and the parameters' gradients; the ops of the forward."""
    module.zero_grad(set_to_none=True)
    with Calls() as calls:
        out, _ = module(x, key, value, key_padding_mask=mask, need_weights=False)
    (gx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    out.backward(grad)
    return [out, gx, *(p.grad for p in module.parameters())], calls.names


@pytest.mark.parametrize("method,role", CASES)
def test_one_packed_matmul_gives_what_three_projections_give(gen, method, role):
    """module(x, x, x) packs (one matmul for q, k, v); module(x, x', x'') with equal copies
    projects apart: the same output and gradients (float64)."""
    torch.manual_seed(0)
    module = build_attention(method, 32, 4, causal=CAUSAL[role], config=dict(SMALL, attention_impl="parallel"))
    module = module.double().eval()
    x = torch.randn(13, 2, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 13, dtype=torch.bool)
    mask[0, :3] = True
    grad = torch.randn(13, 2, 32, generator=gen, dtype=torch.float64)
    packed, packed_ops = run(module, x, x, x, mask, grad)
    apart, apart_ops = run(module, x, x * 1, x * 1, mask, grad)
    matmuls = [names.count("addmm") + names.count("mm") for names in (packed_ops, apart_ops)]
    assert matmuls == [2, 4], matmuls
    for got, want in zip(packed, apart):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_projections_gradients_are_views_of_one_copy_laid_out_as_their_parameters(gen):
    """The packed weights' and biases' gradients go back to q_proj, k_proj and v_proj in one copy each
    (``packed_heads.pack_rows``), each part laid out as its parameter, which autograd then keeps as it is: two copies
    a backward, not six."""
    module = build_attention("lln", 32, 4, causal=True, config=dict(SMALL, attention_impl="parallel"))
    x = torch.randn(7, 2, 32, generator=gen, requires_grad=True)
    out, _ = module(x, x, x, need_weights=False)
    with Calls() as calls:
        out.backward(torch.randn(out.shape, generator=gen))
    assert calls.names.count("clone") + calls.names.count("_unsafe_view") == 2, calls.names
    grads = [p.weight.grad for p in (module.q_proj, module.k_proj, module.v_proj)]
    assert all(g.is_contiguous() and g.shape == (32, 32) for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1


@pytest.mark.parametrize("method,role", [c for c in CASES if c[0] in ("lln", "lln_diag", "lavo", "skyformer")])
def test_fused_gradients_of_packed_q_k_v_are_put_back_without_a_copy(gen, method, role):
    """The fused backward writes dq, dk, dv into one tensor laid out as the packed projection (``new_grads``), so the
    split's backward returns it (``packed_gradient``) instead of stacking three; the gradients equal the
    module's projected apart, bit for bit where the kernels read the same numbers (Skyformer's landmarks add their
    gradients into dq and dk in place)."""
    pytest.importorskip("triton", minversion="3.9")
    torch.manual_seed(0)
    module = build_attention(method, 32, 2, causal=CAUSAL[role], config=dict(SMALL, attention_impl="fused"))
    module = module.half().eval()
    x = torch.randn(19, 2, 32, generator=gen).half().requires_grad_()
    grad = torch.randn(19, 2, 32, generator=gen).half()
    module.zero_grad(set_to_none=True)
    out, _ = module(x, x, x, need_weights=False)
    with Calls() as calls:
        out.backward(grad)
    assert "stack" not in calls.names and "cat" not in calls.names, calls.names
    packed = [x.grad, *(p.grad for p in module.parameters())]
    x.grad = None
    apart, _ = run(module, x, x * 1, x * 1, None, grad)
    for got, want in zip(packed, apart[1:]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)

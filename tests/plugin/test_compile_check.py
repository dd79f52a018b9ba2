"""--attention-compile's net (fairseq_linattn/modules/compile_check.py): a torch older than the verified ones is
refused when the module is built, and each module's first compiled training step is checked against eager: a
wrong compiled gradient stops training with a message that names the method, the torch version and the way out,
and a right one leaves the step exactly as without the check (buffers and random draws put back). The check on
a real compile (Inductor) is in test_attention_compile.py (slow)."""
import re

import pytest
import torch

from fairseq_linattn.modules import build_attention, compile_check

CONFIG = {"attention_compile": True, "lln_chunk_size": 8, "skyformer_landmarks": 6}


class _DoubledGradient(torch.autograd.Function):
    """The identity whose backward doubles the gradient: a compiler bug of the kind torch 2.11 had."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _wrong_compile(module):
    return lambda *args: _DoubledGradient.apply(module.attend(*args))


def _step(module, x, mask):
    out, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
    out.square().mean().backward()
    return out.detach()


def _inputs(gen, n=21):
    x = torch.randn(n, 2, 16, generator=gen, requires_grad=True)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, :5] = True
    return x, mask


@pytest.mark.parametrize("version,refused", [("2.10.1+cu128", True), ("1.13.1", True), ("2.11.0+cu130", False),
                                             ("2.13.0", False)])
def test_a_torch_older_than_the_verified_ones_is_refused_at_build(monkeypatch, version, refused):
    monkeypatch.setattr(torch, "__version__", version)
    if not refused:
        build_attention("lln", 16, 2, causal=True, config=CONFIG)
        return
    with pytest.raises(ValueError, match=rf"--attention-compile needs torch >= 2\.11 .*torch {re.escape(version)} is "
                                         "older"):
        build_attention("lln", 16, 2, causal=True, config=CONFIG)
    build_attention("lln", 16, 2, causal=True, config={**CONFIG, "attention_compile": False})


@pytest.mark.parametrize("method,causal", [("lln", True), ("lavo", True), ("skyformer", False)])
def test_a_wrong_compiled_gradient_stops_the_first_training_step(monkeypatch, gen, method, causal):
    monkeypatch.setattr(compile_check, "compile_attend", _wrong_compile)
    module = build_attention(method, 16, 2, causal=causal, config=CONFIG)
    x, mask = _inputs(gen)
    with pytest.raises(RuntimeError, match=rf"compiled {method} attention differs from eager on its first training "
                                           rf"step with torch {re.escape(torch.__version__)} \(gradient of q: relative "
                                           r"error 1\.00e\+00 > .*--attention-compile-check off"):
        _step(module, x, mask)
    off = build_attention(method, 16, 2, causal=causal, config={**CONFIG, "attention_compile_check": "off"})
    _step(off, x, mask)  # no check: the wrong gradient goes through unnoticed
    with torch.no_grad():
        module.eval()(x, x, x, key_padding_mask=mask)  # eval, no gradient: nothing to check


@pytest.mark.parametrize("method,causal", [("lln", True), ("lln_diag", False), ("skyformer", False)])
def test_a_right_compiled_step_runs_as_without_the_check(monkeypatch, gen, method, causal):
    """Moment statistics (LLN's EMA), random landmarks (Skyformer): two steps with the check on give the eager
    module's outputs, gradients and buffers exactly; the check runs once per module."""
    monkeypatch.setattr(compile_check, "compile_attend", lambda module: module.attend)
    torch.manual_seed(0)
    checked = build_attention(method, 16, 2, causal=causal, config={**CONFIG, "lln_stats": "ema"}
                              if method != "skyformer" else CONFIG)
    eager = build_attention(method, 16, 2, causal=causal, config={**vars(checked.config), "attention_compile": False})
    eager.load_state_dict(checked.state_dict())
    calls = []
    real_check = compile_check.check_first_step
    monkeypatch.setattr(compile_check, "check_first_step", lambda *a: calls.append(1) or real_check(*a))
    for _ in range(2):
        x, mask = _inputs(gen)
        state = torch.get_rng_state()
        out_c = _step(checked, x, mask)
        grad_c, x.grad = x.grad, None
        torch.set_rng_state(state)
        torch.testing.assert_close(out_c, _step(eager, x, mask), rtol=0, atol=0)
        torch.testing.assert_close(grad_c, x.grad, rtol=0, atol=0)
    assert calls == [1]
    for (name, a), b in zip(checked.named_buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for (name, a), b in zip(checked.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def test_a_gradient_zero_in_exact_arithmetic_is_judged_against_the_others():
    """A key bias under a softmax (LAVO's window): 3e-10 of noise on each side, a relative error of 1 by itself;
    judged against the largest gradient it is 0. A wrong small gradient still shows; a missing one is infinite."""
    big, noise = torch.ones(100), torch.full((4,), 3e-10)
    errors = compile_check.gradient_errors([big, -noise], [big, noise])  # norms 10 and 1.2e-9: floor 1e-2
    assert errors == [0.0, pytest.approx(1.2e-9 / 1e-2, rel=1e-6)]
    assert compile_check.gradient_errors([big, torch.full((4,), 0.02)], [big, torch.full((4,), 0.01)])[1] == 1.0
    assert compile_check.gradient_errors([None, None], [big, None]) == [float("inf"), 0.0]

"""Edge shapes for every method x role x implementation: lengths 1, 2, chunk +- 1, window (block) +- 1, fewer tokens
than landmarks, and a batch with a fully padded sequence. Outputs and gradients are finite, real queries get the
reference's values, a query with no visible key gets 0 (docs/design.md §1.1-1.2), and decoding token by token
gives the full forward's rows."""
import contextlib

import pytest
import torch

from fairseq_linattn.modules import build_attention
from linattn.methods import METHODS
from linattn.ops.impls import auto_impl

E, H, B = 8, 2, 3
CHUNK, WINDOW, LANDMARKS = 8, 4, 6  # LLN chunk; LAVO window and LLN+Diag block; Skyformer landmarks
CONFIG = dict(lln_chunk_size=CHUNK, lln_diag_block_size=WINDOW, lavo_window=WINDOW, skyformer_landmarks=LANDMARKS,
              lln_diag_mix="learnable_scale", lln_stats="ema", lln_stats_per_head=True, lavo_bases=3)
# 1, 2; window - 1, window, window + 1; chunk - 1, chunk, chunk + 1; N < landmarks for 1..5
LENGTHS = sorted({1, 2, WINDOW - 1, WINDOW, WINDOW + 1, CHUNK - 1, CHUNK, CHUNK + 1})
assert any(n < LANDMARKS for n in LENGTHS) and any(n > LANDMARKS for n in LENGTHS)


# The ops' two implementations, each a context in which the modules (built with attention_impl "auto") run that
# implementation.
IMPLS = {"looped": contextlib.nullcontext, "parallel": lambda: auto_impl("parallel")}
CASES = [(name, role) for name, m in METHODS.items() for role in m.roles]


def make(name, role, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(name, E, H, causal=role == "decoder", cross=role == "cross", config=CONFIG).double()
    with torch.no_grad():  # parameters away from their symmetric initial values
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for b in module.buffers():
            if b.is_floating_point():
                b.mul_(1 + torch.rand(b.shape, generator=gen, dtype=b.dtype))  # LLN's EMA: alpha != beta per head
    return module.eval()


def edge_mask(n):
    """(B, n): row 0 real, row 1 left-padded (by n // 2), row 2 fully padded."""
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[1, : n // 2] = True
    mask[2] = True
    return mask


def heads(gen, n, requires_grad=False):
    return [torch.randn(B, H, n, E // H, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name,role", CASES)
def test_edge_lengths_and_a_fully_padded_sequence(name, role, impl, gen):
    module = make(name, role, gen)
    for n in LENGTHS:
        q, k, v = heads(gen, n, requires_grad=True)
        mask = edge_mask(n)
        with IMPLS[impl]():
            out = module.attend(q, k if module.uses_keys else None, v, mask)
        ref = module.reference(q.detach(), k.detach(), v.detach(), mask)
        assert out.shape == (B, H, n, E // H) and torch.isfinite(out).all(), (n, out)
        # no query of the fully padded sequence sees a key: each gives 0 (padded queries of a partly padded
        # sequence are computed like any other, and fairseq ignores them)
        assert bool((out[2] == 0).all()), (n, out[2])
        real = ~mask
        torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], rtol=1e-9, atol=1e-11,
                                   msg=lambda m: f"N={n}: {m}")
        g = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        params = [p for p in module.parameters() if p.requires_grad]
        inputs = [q, k, v] if module.uses_keys else [q, v]
        grads = torch.autograd.grad(out, inputs + params, g, allow_unused=True)
        assert all(t is None or torch.isfinite(t).all() for t in grads), n


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name,role", CASES)
def test_edge_lengths_in_training_give_finite_outputs_and_gradients(name, role, impl, gen):
    """Training mode, the default statistics (batch moments for LLN encoders, random Skyformer landmarks)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(name, E, H, causal=role == "decoder", cross=role == "cross",
                             config=dict(lln_chunk_size=CHUNK, lln_diag_block_size=WINDOW, lavo_window=WINDOW,
                                         skyformer_landmarks=LANDMARKS)).double().train()
    for n in LENGTHS:
        x = torch.randn(n, B, E, generator=gen, dtype=torch.float64, requires_grad=True)
        with IMPLS[impl]():
            out, _ = module(x, x, x, key_padding_mask=edge_mask(n))
        assert torch.isfinite(out).all(), n
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all(), n
        assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None), n
        module.zero_grad()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", [name for name, m in METHODS.items() if "decoder" in m.roles])
def test_decoding_edge_lengths_gives_the_full_forward_rows(name, impl, gen):
    """Token by token, the first token included, with a left-padded and a fully padded sequence in the batch."""
    module = make(name, "decoder", gen)
    for n in LENGTHS:
        x = torch.randn(n, B, E, generator=gen, dtype=torch.float64)
        mask = edge_mask(n)
        with IMPLS[impl]():
            full, _ = module(x, x, x, key_padding_mask=mask)
            state, outs = {}, []
            for t in range(n):
                step_mask = mask[:, t:t + 1]
                outs.append(module(x[t:t + 1], x[t:t + 1], x[t:t + 1], key_padding_mask=step_mask,
                                   incremental_state=state)[0])
        steps = torch.cat(outs)
        assert torch.isfinite(steps).all(), n
        torch.testing.assert_close(steps[0, 0], full[0, 0], rtol=1e-10, atol=1e-12)  # the first token
        real = ~mask.t()
        torch.testing.assert_close(steps[real], full[real], rtol=1e-9, atol=1e-11, msg=lambda m: f"N={n}: {m}")

"""Padding changes no real token's output: encoder LLN modules with batch moment matching, and the methods whose
blocks or windows count positions (LLN+Diag, LAVO), left padding included."""
import pytest
import torch

from fairseq_linattn.modules import build_attention

E, H, N = 16, 2, 21
HUGE = 1e4


def make(method, gen, per_head):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    opts = {"lln_stats": "batch", "lln_stats_per_head": per_head, "lln_diag_block_size": 4}
    return build_attention(method, E, H, causal=False, config=opts).double()


def padded(x, left, right, fill):
    """(N, 1, E) -> (left + N + right, 1, E) with ``fill`` at the padded positions, and its (1, T) mask."""
    pads = [torch.full((n, 1, E), fill, dtype=x.dtype) for n in (left, right)]
    mask = torch.tensor([[True] * left + [False] * x.shape[0] + [True] * right])
    return torch.cat([pads[0], x, pads[1]]), mask


@pytest.mark.parametrize("method, left, right", [
    ("lln", 5, 0), ("lln", 0, 7), ("lln", 3, 4),
    ("lln_diag", 8, 0), ("lln_diag", 0, 7), ("lln_diag", 4, 3), ("lln_diag", 5, 0), ("lln_diag", 3, 2),
])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_padded_sequence_gives_its_unpadded_outputs(method, left, right, per_head, training, gen):
    module = make(method, gen, per_head).train(training)
    x = torch.randn(N, 1, E, generator=gen, dtype=torch.float64)
    alone, _ = module(x, x, x)
    alpha = module.matcher.last_alpha
    for fill in (HUGE, -HUGE):  # padded tokens far outside the real ones: in the statistics they would dominate
        xp, mask = padded(x, left, right, fill)
        out, _ = module(xp, xp, xp, key_padding_mask=mask)
        torch.testing.assert_close(module.matcher.last_alpha, alpha, rtol=1e-12, atol=0)
        torch.testing.assert_close(out[left:left + N], alone, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["lln", "lln_diag"])
def test_padding_of_one_sequence_leaves_the_batch_statistics_and_outputs_alone(method, gen):
    # batch statistics pool the sequences: the real tokens decide them, whatever the padding holds
    module = make(method, gen, per_head=True).train()
    x = torch.randn(N, 2, E, generator=gen, dtype=torch.float64)
    mask = torch.zeros(2, N, dtype=torch.bool)
    mask[1, :6] = True
    mask[1, -3:] = True
    outs, alphas = [], []
    for fill in (0.0, HUGE, -HUGE):
        xf = x.masked_fill(mask.t()[:, :, None], fill)
        outs.append(module(xf, xf, xf, key_padding_mask=mask)[0])
        alphas.append(module.matcher.last_alpha)
    real = ~mask.t()
    for out, alpha in zip(outs[1:], alphas[1:]):
        torch.testing.assert_close(alpha, alphas[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(out[real], outs[0][real], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left, right", [(5, 0), (3, 2), (0, 6)])
@pytest.mark.parametrize("method", ["lavo", "lln_diag"])
def test_windows_and_blocks_count_real_tokens(method, left, right, causal, gen):
    # window 4 / block 4 and 5 or 3 padded tokens in front: counted by position, the windows would regroup
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(method, E, H, causal=causal, config={"lavo_window": 4, "lln_diag_block_size": 4,
                                                                  "lln_stats": "ema"}).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    x = torch.randn(N, 1, E, generator=gen, dtype=torch.float64)
    alone, _ = module(x, x, x)
    xp, mask = padded(x, left, right, 3.0)
    out, _ = module(xp, xp, xp, key_padding_mask=mask)
    torch.testing.assert_close(out[left:left + N], alone, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("left, right", [(5, 0), (3, 2)])
@pytest.mark.parametrize("method", ["lavo", "lln_diag"])
def test_decoding_a_padded_sequence_counts_real_tokens_too(method, left, right, gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(method, E, H, causal=True, config={"lavo_window": 4, "lln_diag_block_size": 4}
                             ).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    x = torch.randn(N, 1, E, generator=gen, dtype=torch.float64)
    alone, _ = module(x, x, x)
    xp, mask = padded(x, left, right, 3.0)
    state, outs = {}, []
    for t in range(xp.shape[0]):  # fairseq's decoder: one token per step, its (B, 1) padding mask
        out, _ = module(xp[t:t + 1], xp[t:t + 1], xp[t:t + 1], key_padding_mask=mask[:, t:t + 1],
                        incremental_state=state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs)[left:left + N], alone, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left, right", [(5, 0), (3, 2)])
@pytest.mark.parametrize("method", ["lavo", "lln_diag"])
def test_padded_sequence_gets_its_unpadded_gradients(method, left, right, causal, gen):
    """Through the real-first reordering and back (``real_tokens._GatherRows``, whose backward gathers by the inverse
    permutation): the real tokens' gradients are those of the sequence alone, the padded tokens' are 0, and so are
    the parameters'."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    module = build_attention(method, E, H, causal=causal, config={"lavo_window": 4, "lln_diag_block_size": 4,
                                                                  "lln_stats": "ema"}).double().eval()
    x = torch.randn(N, 1, E, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(N, 1, E, generator=gen, dtype=torch.float64)
    alone, _ = module(x, x, x)
    want = torch.autograd.grad(alone, [x, *module.parameters()], grad)
    xp, mask = padded(x.detach(), left, right, 3.0)
    xp.requires_grad_()
    out, _ = module(xp, xp, xp, key_padding_mask=mask)
    got = torch.autograd.grad(out[left:left + N], [xp, *module.parameters()], grad)
    torch.testing.assert_close(got[0][left:left + N], want[0], rtol=1e-9, atol=1e-12)
    assert not got[0][:left].any() and not got[0][left + N:].any()
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)

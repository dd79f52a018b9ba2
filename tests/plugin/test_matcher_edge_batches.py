"""The moment matcher (LLN §4.1) on batches without a real token, in one process: no sequence (B = 0), no token
(N = 0), every token padded, and a forward left out of the statistics (a fairseq dummy batch). The EMA buffers
fold nothing in and stay finite, alpha and beta stay finite, and a batch without tokens gives batch statistics
the documented variance 1; a fully padded sequence beside real ones changes nothing."""
import pytest
import torch
from helpers import padding_mask

from fairseq_linattn.modules.moment_matcher import MomentMatcher, statistics_left_out
from linattn.ops import lln_alpha_beta

F64 = torch.float64
H, D = 2, 4


def _qk(gen, b=3, n=9, scale_q=2.0, scale_k=0.5):
    return (scale_q * torch.randn(b, H, n, D, generator=gen, dtype=F64) + 0.3,
            scale_k * torch.randn(b, H, n, D, generator=gen, dtype=F64))


def _no_token_batches(gen):
    """(name, q, k, mask, left_out) of forwards that see no real token; padded entries hold huge values."""
    q, k = _qk(gen)
    full = torch.ones(3, 9, dtype=torch.bool)
    huge = lambda x: x.masked_fill(full[:, None, :, None], 1e3)
    empty_b, empty_n = torch.zeros(0, H, 9, D, dtype=F64), torch.zeros(3, H, 0, D, dtype=F64)
    return [("no sequence", empty_b, empty_b, torch.zeros(0, 9, dtype=torch.bool), False),
            ("no token", empty_n, empty_n, torch.zeros(3, 0, dtype=torch.bool), False),
            ("no token, no mask", empty_n, empty_n, None, False),
            ("fully padded", huge(q), huge(k), full, False),
            ("left out", q, k, None, True)]


@pytest.mark.parametrize("per_head", [False, True])
def test_ema_folds_nothing_from_batches_without_tokens(gen, per_head):
    matcher = MomentMatcher("paper", head_dim=D, num_heads=H, per_head=per_head, stats="ema",
                            ema_momentum=0.5).train()
    matcher(*_qk(gen))  # buffers away from their initial 1
    buffers = matcher.ema_var_q.clone(), matcher.ema_var_k.clone()
    assert not torch.equal(buffers[0], torch.ones_like(buffers[0]))
    expected = matcher.current(torch.zeros(1, dtype=F64))
    for name, q, k, mask, left_out in _no_token_batches(gen):
        with statistics_left_out() if left_out else torch.enable_grad():
            alpha, beta = matcher(q, k, mask)
        assert torch.isfinite(alpha).all() and torch.isfinite(beta).all(), name
        torch.testing.assert_close((alpha, beta), expected, rtol=0, atol=0, msg=name)
        assert torch.equal(matcher.ema_var_q, buffers[0]) and torch.equal(matcher.ema_var_k, buffers[1]), name
        torch.testing.assert_close(matcher.current(torch.zeros(1, dtype=F64)), expected, rtol=0, atol=0, msg=name)
    matcher(*_qk(gen, scale_q=0.2))  # a real batch is folded in again
    assert not torch.equal(matcher.ema_var_q, buffers[0])
    assert torch.isfinite(matcher.ema_var_q).all() and torch.isfinite(matcher.ema_var_k).all()


@pytest.mark.parametrize("per_head", [False, True])
def test_batch_statistics_of_batches_without_tokens_are_variance_one(gen, per_head):
    matcher = MomentMatcher("paper", head_dim=D, num_heads=H, per_head=per_head).train()
    one = torch.ones(H if per_head else 1, dtype=F64)
    want = tuple(t.view(1, -1, 1, 1) for t in lln_alpha_beta(one, one))
    for name, q, k, mask, left_out in _no_token_batches(gen):
        with statistics_left_out() if left_out else torch.enable_grad():
            alpha, beta = matcher(q, k, mask)
        torch.testing.assert_close((alpha, beta), want, rtol=1e-12, atol=0, msg=name)
        torch.testing.assert_close(matcher.last_sigma_q, one, rtol=0, atol=0, msg=name)
        assert torch.isfinite(matcher.last_tau).all(), name


@pytest.mark.parametrize("stats", ["batch", "ema"])
def test_a_fully_padded_sequence_beside_real_ones_changes_nothing(gen, stats):
    q, k = _qk(gen)
    mask = padding_mask(3, 9, "right", gen)
    with_padded_q = torch.cat([q, torch.full_like(q[:1], 1e3)])
    with_padded_k = torch.cat([k, torch.full_like(k[:1], -1e3)])
    with_padded_mask = torch.cat([mask, torch.ones_like(mask[:1])])
    results = []
    for args in ((q, k, mask), (with_padded_q, with_padded_k, with_padded_mask)):
        matcher = MomentMatcher("paper", head_dim=D, num_heads=H, per_head=True, stats=stats).train()
        out = [matcher(*args), matcher(*args)]  # the second forward sees what the first folded in (ema)
        results.append((out, getattr(matcher, "ema_var_q", None)))
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=0)

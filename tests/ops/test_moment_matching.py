"""LLN moment matching (docs/design.md §3.1): the matched var(log P_LLN) equals softmax's sigma_q² sigma_k².

sigma is the std of the entries of q, k as softmax receives them (scores q·k/sqrt(D)), so softmax's
score variance is sigma_q² sigma_k²; the first test pins that convention down.
"""
import json
import math
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import padding_mask

from fairseq_linattn.modules.moment_matcher import MomentMatcher
from linattn import ops
from linattn.ops.moment_matching import (
    PAPER_A,
    PAPER_B,
    exact_moment_table,
    fit_moment_constants,
    lln_alpha_beta,
    lln_variance_log_p,
    load_constants,
)
from linattn_tools.fit_moments import main

F64 = torch.float64
SIGMAS = [0.5, 0.75, 1.0, 1.25, 1.5]


@pytest.fixture(autouse=True)
def one_thread():
    """The Monte-Carlo loops run many mid-sized ops: on a loaded 2-core machine one thread is far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh_seed(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def var_log_p_materialised(q, k, alpha, beta):
    """Pooled var of log P_LLN from the paper's formula (eq. 8-9), q (M, Q, D), k (M, N, D), float64.

    log P_ij = logsumexp_d(alpha q_id + beta k_jd) - logsumexp_{l,d}(alpha q_id + beta k_ld).
    """
    total, total_sq, count = 0.0, 0.0, 0
    for qc, kc in zip((alpha * q).split(8), (beta * k).split(8)):  # 8 matrices at a time
        num = torch.logsumexp(qc[:, :, None, :] + kc[:, None, :, :], -1)  # (m, Q, N)
        log_p = num - torch.logsumexp(num, -1, keepdim=True)
        total, total_sq, count = total + log_p.sum(), total_sq + log_p.square().sum(), count + log_p.numel()
    return (total_sq / count - (total / count) ** 2).item()


def test_softmax_log_p_variance_is_sigma_q2_sigma_k2(mc_gen):
    """The target of the matching: softmax(q k^T / sqrt(D)) with entry stds sigma_q, sigma_k."""
    d, n = 64, 256
    for sigma_q, sigma_k in [(1.0, 1.0), (0.5, 1.0), (0.8, 0.6)]:
        q = sigma_q * torch.randn(16, n, d, generator=mc_gen, dtype=F64)
        k = sigma_k * torch.randn(16, n, d, generator=mc_gen, dtype=F64)
        log_p = torch.log_softmax(q @ k.transpose(1, 2) / math.sqrt(d), -1)
        assert log_p.var().item() == pytest.approx(sigma_q ** 2 * sigma_k ** 2, rel=0.05)


def test_variance_log_p_agrees_with_materialised_lln(mc_gen):
    d, n, m, rows = 16, 128, 512, 16
    seed = fresh_seed(mc_gen)
    for s in (0.7, 2.0):
        fast = lln_variance_log_p(s, d, n, num_matrices=m, num_queries=rows, seed=seed).item()
        q = torch.randn(m, rows, d, generator=mc_gen, dtype=F64)
        k = torch.randn(m, n, d, generator=mc_gen, dtype=F64)
        assert fast == pytest.approx(var_log_p_materialised(q, k, s, s), rel=0.04)


def test_variance_log_p_grows_with_scale_and_shrinks_with_head_dim():
    v32 = lln_variance_log_p(torch.tensor([0.5, 1.0, 2.0, 4.0]), 32, 256)
    v128 = lln_variance_log_p(torch.tensor([0.5, 1.0, 2.0, 4.0]), 128, 256)
    assert v32.shape == (4,) and bool((v32.diff() > 0).all()) and bool((v128 < v32).all())


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_exact_matches_softmax_variance(mc_gen, head_dim):
    n = 512
    table = exact_moment_table(head_dim, n)
    sigmas = torch.tensor(SIGMAS, dtype=F64)
    alpha, beta = table.alpha_beta(sigmas, sigmas)
    assert torch.equal(alpha, beta)
    measured = lln_variance_log_p(alpha * sigmas, head_dim, n, num_matrices=128, seed=fresh_seed(mc_gen))
    rel = measured / sigmas ** 4 - 1
    print(f"D={head_dim} exact-mode relative errors at sigma={SIGMAS}: {[round(x, 4) for x in rel.tolist()]}")
    assert rel.abs().max().item() < 0.05


@pytest.mark.parametrize("sigma_q, sigma_k", [(0.6, 1.4), (1.5, 0.8)])
def test_exact_matches_softmax_variance_with_unequal_sigmas_on_materialised_p(mc_gen, sigma_q, sigma_k):
    d, n = 64, 512
    alpha, beta = exact_moment_table(d, n).alpha_beta(sigma_q, sigma_k)
    assert alpha * sigma_q == pytest.approx(beta * sigma_k, rel=1e-12)  # eq. 10
    q = sigma_q * torch.randn(128, 16, d, generator=mc_gen, dtype=F64)
    k = sigma_k * torch.randn(128, n, d, generator=mc_gen, dtype=F64)
    measured = var_log_p_materialised(q, k, alpha, beta)
    assert measured == pytest.approx(sigma_q ** 2 * sigma_k ** 2, rel=0.05)


def test_exact_table_is_monotone_and_inverts_itself():
    table = exact_moment_table(64, 512)
    assert bool((table.log_var.diff() >= 0).all())
    s2 = torch.tensor([0.01, 0.5, 3.0, 20.0, 400.0], dtype=F64)  # beyond both ends of the grid too
    torch.testing.assert_close(table.s2_for_variance(table.variance(s2)), s2, rtol=1e-9, atol=0)


def test_fit_d32_reproduces_published_slope(mc_gen):
    a, b = fit_moment_constants(32, 512, (1.0, 4.0), seed=fresh_seed(mc_gen))
    print(f"fit D=32 N=512 range [1, 4]: a={a:.4f} (published {PAPER_A:.4f}), b={b:.4f} (published {PAPER_B:.4f})")
    assert a == pytest.approx(PAPER_A, rel=0.10)


@pytest.mark.parametrize("head_dim, variance_range", [(32, (1.0, 4.0)), (64, (2.0, 8.0))])
def test_fit_matches_softmax_variance_at_sigma_1(mc_gen, head_dim, variance_range):
    """A linear fit is local: its range must hold the operating point (s² ≈ 4-6 at sigma = 1)."""
    a, b = fit_moment_constants(head_dim, 512, variance_range, seed=fresh_seed(mc_gen))
    alpha, _ = lln_alpha_beta(1.0, 1.0, a, b)
    measured = lln_variance_log_p(alpha, head_dim, 512, num_matrices=128, seed=fresh_seed(mc_gen)).item()
    print(f"fit D={head_dim} range {variance_range}: var(log P_LLN) at sigma=1 is {measured:.3f}")
    assert measured == pytest.approx(1.0, rel=0.15)


def test_paper_alpha_beta_follow_prop_4_1():
    assert (PAPER_A, PAPER_B) == (0.14855178144710912, -0.35487039130661086)
    for sigma_q, sigma_k in [(1.0, 1.0), (0.5, 2.0), (1.7, 0.9)]:
        s2 = (sigma_q ** 2 * sigma_k ** 2 - PAPER_B) / (2 * PAPER_A)
        alpha, beta = lln_alpha_beta(sigma_q, sigma_k)
        assert isinstance(alpha, float)
        assert alpha == pytest.approx(math.sqrt(s2) / sigma_q, rel=1e-12)
        assert beta == pytest.approx(math.sqrt(s2) / sigma_k, rel=1e-12)
    sq, sk = torch.tensor([[1.0], [0.5]]), torch.tensor([1.0, 2.0, 1.7])
    alpha, beta = lln_alpha_beta(sq, sk)
    assert alpha.shape == beta.shape == (2, 3)
    assert alpha[1, 1].item() == pytest.approx(lln_alpha_beta(0.5, 2.0)[0], rel=1e-12)


def test_alpha_beta_clamps():
    alpha, beta = lln_alpha_beta(0.0, 1.0)  # sigma_q clamped to 1e-3 -> alpha would be ~1e3
    assert alpha == 8.0 and beta == pytest.approx(math.sqrt(-PAPER_B / (2 * PAPER_A) + 1e-6 / (2 * PAPER_A)))
    assert lln_alpha_beta(0.0, 1.0, max_scale=3.0)[0] == 3.0
    alpha, beta = lln_alpha_beta(0.1, 0.1, a=0.15, b=0.5)  # target below b: s² clamped, not negative
    assert 0 < alpha < 1e-2 and alpha == beta
    alpha, beta = exact_moment_table(32, 512).alpha_beta(1e-6, 100.0)
    assert alpha == 8.0 and 0 < beta < 8.0
    for kwargs, name in [({"a": 0.0}, "a "), ({"a": -1.0}, "a "), ({"max_scale": 0.0}, "max_scale")]:
        with pytest.raises(ValueError, match=name):
            lln_alpha_beta(1.0, 1.0, **kwargs)


# -- MomentMatcher ---------------------------------------------------------------------------------


def qk(gen, b=3, h=4, n=10, d=8, scale_q=1.3, scale_k=0.7):
    return (scale_q * torch.randn(b, h, n, d, generator=gen, dtype=F64) + 0.2,
            scale_k * torch.randn(b, h, n, d, generator=gen, dtype=F64))


@pytest.mark.parametrize("per_head", [False, True])
def test_matcher_uses_only_non_padded_tokens(gen, per_head):
    q, k = qk(gen)
    mask = padding_mask(3, 10, "right", gen)
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, per_head=per_head)
    alpha, beta = matcher(q, k, mask)
    pad = mask[:, None, :, None]
    alpha2, beta2 = matcher(q.masked_fill(pad, 1e3), k.masked_fill(pad, -1e3), mask)
    torch.testing.assert_close((alpha2, beta2), (alpha, beta), rtol=1e-12, atol=0)
    keep = ~mask  # q.transpose(1, 2)[keep]: (tokens, H, D)
    sigma_q = q.transpose(1, 2)[keep].std(dim=(0, 2) if per_head else None, unbiased=False)
    sigma_k = k.transpose(1, 2)[keep].std(dim=(0, 2) if per_head else None, unbiased=False)
    ref_alpha, ref_beta = lln_alpha_beta(sigma_q, sigma_k)
    assert alpha.shape == ((1, 4, 1, 1) if per_head else (1, 1, 1, 1))
    torch.testing.assert_close(alpha.flatten(), ref_alpha.reshape(-1), rtol=1e-10, atol=0)
    torch.testing.assert_close(beta.flatten(), ref_beta.reshape(-1), rtol=1e-10, atol=0)
    torch.testing.assert_close(matcher.last_sigma_q, sigma_q.reshape(-1), rtol=1e-10, atol=0)


def test_matcher_records_temperature_of_eq_11(gen):
    q, k = qk(gen)
    for mode in ("paper", "exact"):
        matcher = MomentMatcher(mode, head_dim=8, num_heads=4, per_head=True)
        matcher(q, k)
        # matched: tau_lln = tau_sm = 1 / (sigma_q sigma_k)
        torch.testing.assert_close(matcher.last_tau, 1 / (matcher.last_sigma_q * matcher.last_sigma_k), rtol=1e-6,
                                   atol=0)
        assert matcher.last_alpha.shape == matcher.last_beta.shape == (4,)


def test_matcher_exact_mode_uses_the_table(gen):
    q, k = qk(gen, d=32)
    matcher = MomentMatcher("exact", head_dim=32, num_heads=4)
    alpha, beta = matcher(q, k)
    ref = exact_moment_table(32, 512).alpha_beta(q.std(unbiased=False), k.std(unbiased=False))
    torch.testing.assert_close((alpha.flatten(), beta.flatten()), (ref[0].reshape(1), ref[1].reshape(1)))


def test_ema_forward_uses_statistics_from_before_the_batch(gen):
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema", ema_momentum=0.9).train()
    q1, k1 = qk(gen)
    q2, k2 = qk(gen, scale_q=5.0, scale_k=0.1)
    before = lln_alpha_beta(1.0, 1.0)
    for q, k in ((q1, k1), (q2, k2)):  # the first forward's output depends on no batch
        fresh = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema", ema_momentum=0.9).train()
        alpha, beta = fresh(q, k)
        assert (alpha.item(), beta.item()) == pytest.approx(before, rel=1e-12)
    mask = padding_mask(3, 10, "left", gen)
    alpha, beta = matcher(q1, k1, mask)
    assert (alpha.item(), beta.item()) == pytest.approx(before, rel=1e-12)
    keep = ~mask
    var_q = q1.transpose(1, 2)[keep].var(unbiased=False).item()
    var_k = k1.transpose(1, 2)[keep].var(unbiased=False).item()
    assert matcher.ema_var_q.item() == pytest.approx(0.9 + 0.1 * var_q, rel=1e-6)
    assert matcher.ema_var_k.item() == pytest.approx(0.9 + 0.1 * var_k, rel=1e-6)
    expected = lln_alpha_beta(math.sqrt(0.9 + 0.1 * var_q), math.sqrt(0.9 + 0.1 * var_k))
    alpha, beta = matcher(q2, k2)  # uses the buffer after batch 1, not batch 2
    assert (alpha.item(), beta.item()) == pytest.approx(expected, rel=1e-6)


def test_ema_skips_a_batch_with_non_finite_activations(gen):
    # an fp16 forward that overflowed is skipped by fairseq's loss scaler; it must not poison the EMA
    # (a NaN buffer would make every later alpha, beta and loss NaN)
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema", ema_momentum=0.9).train()
    q, k = qk(gen)
    matcher(q, k)
    before = (matcher.ema_var_q.clone(), matcher.ema_var_k.clone())
    for bad in (float("inf"), float("nan")):
        q_bad = q.clone()
        q_bad[0, 1, 2, 3] = bad
        matcher(q_bad, k)
        assert torch.equal(matcher.ema_var_q, before[0]) and torch.equal(matcher.ema_var_k, before[1])
    alpha, beta = matcher(q, k)  # training goes on with finite values and folds good batches in again
    assert torch.isfinite(alpha).all() and torch.isfinite(beta).all()
    assert not torch.equal(matcher.ema_var_q, before[0])


def test_ema_eval_freezes_the_buffers(gen):
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema", per_head=True)
    matcher.train()(*qk(gen))
    frozen = (matcher.ema_var_q.clone(), matcher.ema_var_k.clone())
    assert not torch.equal(frozen[0], torch.ones(4))
    matcher.eval()
    outs = [matcher(*qk(gen, scale_q=s)) for s in (0.3, 3.0)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert torch.equal(matcher.ema_var_q, frozen[0]) and torch.equal(matcher.ema_var_k, frozen[1])
    alpha, beta = lln_alpha_beta(frozen[0].double().sqrt(), frozen[1].double().sqrt())
    assert outs[0][0].shape == (1, 4, 1, 1)
    torch.testing.assert_close(outs[0][0].flatten(), alpha)
    torch.testing.assert_close(matcher.current(torch.zeros(1, dtype=F64)), outs[0])


def test_ema_buffers_stay_float32_under_half(gen):
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema").half()
    assert matcher.ema_var_q.dtype == matcher.ema_var_k.dtype == torch.float32
    q, k = qk(gen)
    alpha, beta = matcher.train()(q.half(), k.half())
    assert alpha.dtype == torch.float32 and matcher.ema_var_q.item() != 1.0
    assert matcher.state_dict()["ema_var_q"].dtype == torch.float32


def test_off_mode_returns_the_fixed_values(gen):
    matcher = MomentMatcher("off", head_dim=8, num_heads=4, per_head=True, fixed_alpha=2.0, fixed_beta=3.0)
    alpha, beta = matcher(*qk(gen))
    assert alpha.shape == (1, 4, 1, 1) and bool((alpha == 2.0).all()) and bool((beta == 3.0).all())
    alpha, beta = matcher.current(torch.zeros(1))
    assert bool((alpha == 2.0).all()) and bool((beta == 3.0).all())


def test_fit_command_writes_constants_the_matcher_loads(tmp_path, gen):
    out = tmp_path / "constants.json"
    main(["--head-dim", "16", "--seq-len", "64", "--range", "1", "4", "--num-points", "4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"a", "b", "head_dim", "seq_len", "range"} and data["range"] == [1.0, 4.0]
    assert data["a"] > 0 and load_constants(str(out))["a"] == data["a"]
    q, k = qk(gen, d=16)
    matcher = MomentMatcher("fit", head_dim=16, num_heads=4, constants_file=str(out))
    alpha, _ = matcher(q, k)
    expected = lln_alpha_beta(q.std(unbiased=False).item(), k.std(unbiased=False).item(), data["a"], data["b"])
    assert alpha.item() == pytest.approx(expected[0], rel=1e-10)
    with pytest.raises(ValueError, match="constants_file"):
        MomentMatcher("fit", head_dim=32, constants_file=str(out))
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": -1, "b": 0}')
    with pytest.raises(ValueError, match="constants_file"):
        load_constants(str(bad))


@pytest.mark.parametrize("kwargs, name", [
    ({"mode": "softmax"}, "mode"),
    ({"stats": "running"}, "stats"),
    ({"ema_momentum": 1.0}, "ema_momentum"),
    ({"max_scale": 0.0}, "max_scale"),
    ({"head_dim": 0}, "head_dim"),
    ({"mode": "off"}, "fixed_alpha"),
    ({"mode": "paper", "fixed_alpha": 2.0, "fixed_beta": 2.0}, "fixed_alpha"),
    ({"mode": "off", "fixed_alpha": 2.0, "fixed_beta": -1.0}, "fixed_beta"),
    ({"mode": "fit"}, "constants_file"),
    ({"mode": "paper", "constants_file": "c.json"}, "constants_file"),
    ({"a": 0.0}, "a "),
])
def test_matcher_rejects_bad_options(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MomentMatcher(**{"head_dim": 8, **kwargs})


def test_matcher_rejects_bad_inputs(gen):
    q, k = qk(gen)
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, per_head=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        matcher(q, k, torch.zeros(3, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_heads"):
        matcher(q[:, :2], k[:, :2])
    with pytest.raises(ValueError, match="stats='ema'"):
        matcher.current(q)


def test_ops_exports_lln_alpha_beta():
    assert ops.lln_alpha_beta(1.0, 1.0) == lln_alpha_beta(1.0, 1.0)


# -- distributed: every rank uses the same alpha, beta ---------------------------------------------


def _ddp_worker(rank, world_size, port, out_dir, batches):
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        q, k, mask = batches[rank]
        batch = MomentMatcher("paper", head_dim=8, num_heads=4, per_head=True).train()
        ema = MomentMatcher("exact", head_dim=8, num_heads=4, stats="ema", seq_len=64).train()
        ema(q, k, mask)
        torch.save({"batch": batch(q, k, mask), "ema": ema(q, k, mask), "ema_var_q": ema.ema_var_q},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_ranks_share_alpha_beta_of_the_global_batch(tmp_path, gen):
    batches = []
    for b, n, scale in ((2, 12, 1.0), (3, 12, 2.5)):  # different sizes and spreads per rank
        q, k = qk(gen, b=b, n=n, scale_q=scale)
        batches.append((q, k, padding_mask(b, n, "right", gen)))
    ctx = mp.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path), batches), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("distributed workers did not finish in 60 s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    q, k, mask = (torch.cat(parts) for parts in zip(*batches))
    single = MomentMatcher("paper", head_dim=8, num_heads=4, per_head=True).train()
    ema = MomentMatcher("exact", head_dim=8, num_heads=4, stats="ema", seq_len=64).train()
    ema(q, k, mask)
    expected = {"batch": single(q, k, mask), "ema": ema(q, k, mask), "ema_var_q": ema.ema_var_q}
    assert not torch.allclose(MomentMatcher("paper", head_dim=8, num_heads=4, per_head=True)(*batches[0])[0],
                              expected["batch"][0])  # a rank alone would differ
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-10, atol=0)


def test_ema_activation_checkpointing_sees_one_buffer_and_folds_once(gen):
    # fairseq's checkpoint_wrapper runs the forward without grad, then again (with grad) in backward
    matcher = MomentMatcher("paper", head_dim=8, num_heads=4, stats="ema", ema_momentum=0.5).train()
    q, k = qk(gen, scale_q=3.0)
    with torch.no_grad():
        first = matcher(q, k)
    assert torch.equal(matcher.ema_var_q, torch.ones(1))  # the no-grad pass leaves the buffer alone
    recomputed = matcher(q, k)
    torch.testing.assert_close(recomputed, first, rtol=0, atol=0)
    assert matcher.ema_var_q.item() == pytest.approx(0.5 + 0.5 * q.var(unbiased=False).item(), rel=1e-6)

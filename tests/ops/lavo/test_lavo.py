"""LAVO ops (docs/design.md §6): fast windowed form vs the materialised reference, causality, padding,
gradients, half precision, token-by-token decoding and argument errors."""
import functools

import pytest
import torch
from helpers import rel_err

from linattn import ops
from linattn.ops.lavo import (
    lavo_attention,
    lavo_attention_reference,
    lavo_cross_attention_reference,
    lavo_cross_memory,
    lavo_cross_readout,
    lavo_decode_step,
    lavo_init_bases,
    lavo_init_state,
)

B, H, D = 2, 3, 8

# (window, num_bases, N): N < w, N not a multiple of w, N a multiple, r < D, r = D, w = 1
SHAPES = [(8, 8, 5), (4, 5, 11), (4, 8, 12), (3, 2, 10), (1, 4, 6), (6, 8, 25)]


@pytest.fixture(params=["parallel", "looped"])
def impl(request):
    """The op's implementation (``linattn.ops.impls``): every op test runs both."""
    return request.param


def _fresh_seed() -> int:
    """A new seed on every call, printed so that a failure can be replayed."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed())))
    print(f"random seed: {seed}")
    return seed


def _inputs(n, w, r, dtype=torch.float64, b=B, h=H, d=D):
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.random.fork_rng():  # the bases' orthogonal_ draws from the global RNG
        torch.manual_seed(seed)
        bases = lavo_init_bases(h, r, d, dtype=torch.float64)
    pos_bias = 0.5 * torch.randn(h, 2 * w - 1, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, bases, pos_bias)]


def _padding(n, b=B):
    """Row 0 right-padded, row 1 left-padded (at least one real token each)."""
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[0, n - n // 3:] = True
    mask[1, : n // 4] = True
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("w,r,n", SHAPES)
def test_lavo_matches_reference_float64(w, r, n, causal, padded, impl):
    q, k, v, bases, pos_bias = _inputs(n, w, r)
    mask = _padding(n) if padded else None
    out = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl)
    ref = lavo_attention_reference(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, H, n, D) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("w,r,n", [(4, 5, 11), (16, 8, 70)])
def test_lavo_float32_matches_float64_reference(w, r, n, causal, impl):
    args64 = _inputs(n, w, r)
    mask = _padding(n)
    ref = lavo_attention_reference(*args64, window=w, causal=causal, key_padding_mask=mask)
    out = lavo_attention(*(t.float() for t in args64), window=w, causal=causal, key_padding_mask=mask, impl=impl)
    assert out.dtype == torch.float32
    assert rel_err(out.double(), ref) < 1e-5


def test_lavo_is_exported_from_ops():
    assert ops.lavo_attention is lavo_attention and ops.lavo_attention_reference is lavo_attention_reference


def test_lavo_memory_changes_output_after_first_window(impl):
    """Window 0 is F_local alone; later windows mix in the memory (so the global part is live)."""
    w, n = 4, 12
    q, k, v, bases, pos_bias = _inputs(n, w, D)
    full = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=True, impl=impl)
    v2 = v.clone()
    v2[:, :, 0] += 3.0  # token 0 is outside the local window of tokens >= 4: only the memory carries it
    moved = lavo_attention(q, k, v2, bases, pos_bias, window=w, causal=True, impl=impl)
    assert (moved - full)[:, :, w:].abs().amax() > 1e-3


@pytest.mark.parametrize("what", ["values", "keys", "queries"])
@pytest.mark.parametrize("w,n,j", [(4, 13, 6), (4, 13, 8), (5, 12, 3)])
def test_causal_lavo_ignores_future_tokens(what, w, n, j, impl):
    q, k, v, bases, pos_bias = _inputs(n, w, 6, dtype=torch.float32)
    out = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=True, impl=impl)
    changed = {"queries": q, "keys": k, "values": v}[what].clone()
    changed[:, :, j:] *= 10.0
    args = {"queries": (changed, k, v), "keys": (q, changed, v), "values": (q, k, changed)}[what]
    out2 = lavo_attention(*args, bases, pos_bias, window=w, causal=True, impl=impl)
    torch.testing.assert_close(out2[:, :, :j], out[:, :, :j], rtol=1e-6, atol=1e-6)
    assert (out2[:, :, j:] - out[:, :, j:]).abs().amax() > 1e-3  # the change is visible downstream


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_lavo_ignores_padded_tokens(side, causal, impl):
    w, n = 4, 14
    q, k, v, bases, pos_bias = _inputs(n, w, 6, dtype=torch.float32)
    mask = torch.zeros(B, n, dtype=torch.bool)
    if side == "right":
        mask[0, 9:] = True
        mask[1, 12:] = True
    else:
        mask[0, :5] = True
        mask[1, :2] = True
    out = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl)
    q2, k2, v2 = (t.masked_fill(mask[:, None, :, None], 1e3) for t in (q, k, v))
    out2 = lavo_attention(q2, k2, v2, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl)
    keep = ~mask[:, None, :, None]
    torch.testing.assert_close(out2 * keep, out * keep, rtol=1e-6, atol=1e-6)


def test_lavo_rows_without_valid_keys_give_zero(impl):
    w, n = 4, 10
    q, k, v, bases, pos_bias = _inputs(n, w, 6)
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[0, :6] = True  # causal: queries 0..5 of row 0 see only padded keys
    mask[1, :] = True  # non-causal: a fully padded row
    for causal, rows in ((True, (0, slice(0, 6))), (False, (1, slice(None)))):
        for fn in (functools.partial(lavo_attention, impl=impl), lavo_attention_reference):
            q_ = q.clone().requires_grad_()
            out = fn(q_, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask)
            out.sum().backward()
            assert torch.isfinite(out).all() and torch.isfinite(q_.grad).all()
            assert out[rows[0], :, rows[1]].abs().amax() == 0


@pytest.mark.parametrize("causal", [True, False])
def test_lavo_gradients_reach_bases_and_pos_bias(causal, impl):
    w, n = 4, 11
    q, k, v, bases, pos_bias = _inputs(n, w, 6, dtype=torch.float32)
    bases.requires_grad_()
    pos_bias.requires_grad_()
    out = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=_padding(n), impl=impl)
    (out * torch.randn_like(out)).sum().backward()
    used = slice(0, w) if causal else slice(None)  # causal offsets j - t <= 0 use P[0 .. w-1] only
    for g in (bases.grad, pos_bias.grad[:, used]):
        assert torch.isfinite(g).all()
        assert (g.abs() > 0).float().mean() > 0.9


@pytest.mark.parametrize("causal", [True, False])
def test_lavo_gradcheck_float64(causal, impl):
    w, n = 3, 7
    args = [t.requires_grad_() for t in _inputs(n, w, 4, b=1, h=2, d=4)]
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, -1] = True
    assert torch.autograd.gradcheck(
        lambda *a: lavo_attention(*a, window=w, causal=causal, key_padding_mask=mask, impl=impl), args)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("w,n", [(3, 7), (4, 12), (3, 12), (4, 9)])
def test_lavo_gradcheck_float64_without_padding(causal, w, n, impl):
    """No padding mask: the causal path takes the hand-written windowed backward."""
    args = [t.requires_grad_() for t in _inputs(n, w, 4, b=2, h=2, d=4)]
    assert torch.autograd.gradcheck(lambda *a: lavo_attention(*a, window=w, causal=causal, impl=impl), args)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_lavo_half_precision_is_finite_and_close_to_fp32(dtype, tol, causal, impl):
    w, n = 8, 37
    q, k, v, bases, pos_bias = _inputs(n, w, D, dtype=torch.float32)
    mask = _padding(n)
    ref = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=causal, key_padding_mask=mask, impl=impl)
    out = lavo_attention(*(t.to(dtype) for t in (q, k, v, bases, pos_bias)), window=w, causal=causal,
                         key_padding_mask=mask, impl=impl)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out.float(), ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("w,n", [(4, 11), (8, 5), (1, 4), (3, 9)])
def test_lavo_decode_steps_equal_causal_forward(dtype, tol, w, n, impl):
    r = 5
    q, k, v, bases, pos_bias = _inputs(n, w, r, dtype=dtype)
    full = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=True, impl=impl)
    state = lavo_init_state(B, H, D, r, window=w, dtype=dtype)
    steps = []
    for t in range(n):
        out, state = lavo_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], bases, pos_bias,
                                      state, window=w)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=tol, atol=tol)


def _decode_masks(n):
    """(3, N) masks: left-padded, right-padded, and padding on both sides and in the middle."""
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[0, : n // 2] = True
    mask[1, n - n // 3:] = True
    mask[2, :2] = mask[2, n // 2] = mask[2, -1] = True
    return mask


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("w,n", [(4, 13), (3, 9), (1, 5), (8, 11)])
def test_lavo_decode_steps_with_padding_equal_causal_forward_over_real_tokens(dtype, tol, w, n, impl):
    """Each step gets its (B, 1) padding mask (None when the step has none, as fairseq's decoder passes
    it); padded tokens (huge values) enter no window and no memory and count no position: the real outputs
    are those of each row's real tokens alone (here: moved to the front, padding at the end)."""
    r = 5
    q, k, v, bases, pos_bias = _inputs(n, w, r, dtype=dtype, b=3)
    mask = _decode_masks(n)
    assert (mask[:, :-1] & ~mask[:, 1:]).any()  # some padding before real tokens
    k, v = (x.masked_fill(mask[:, None, :, None], 1e3) for x in (k, v))
    order = torch.sort(mask.to(torch.uint8), dim=1, stable=True).indices
    tok = lambda x, o: x.gather(2, o[:, None, :, None].expand_as(x))
    first = [tok(x, order) for x in (q, k, v)]
    back = order.argsort(1)
    full = tok(lavo_attention(*first, bases, pos_bias, window=w, causal=True,
                              key_padding_mask=mask.gather(1, order), impl=impl), back)
    ref = tok(lavo_attention_reference(*(x.double() for x in first), bases.double(), pos_bias.double(), window=w,
                                       causal=True, key_padding_mask=mask.gather(1, order)), back)
    state = lavo_init_state(3, H, D, r, window=w, dtype=dtype)
    steps = []
    for t in range(n):
        step_mask = mask[:, t:t + 1] if mask[:, t].any() else None
        out, state = lavo_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], bases, pos_bias,
                                      state, window=w, key_padding_mask=step_mask)
        steps.append(out)
    real = ~mask[:, None, :, None].expand_as(full)
    steps = torch.cat(steps, 2)
    assert torch.isfinite(steps).all()
    assert rel_err(steps[real], full[real]) < tol
    assert rel_err(steps[real].double(), ref[real]) < tol


def test_lavo_decode_state_reorders_by_index_select(impl):
    """Beam reordering = index_select on dim 0 of every state tensor, then decoding continues correctly."""
    w, n, r = 3, 8, 4
    q, k, v, bases, pos_bias = _inputs(n, w, r)
    order = torch.tensor([1, 1, 0])
    state = lavo_init_state(B, H, D, r, window=w, dtype=torch.float64)
    for t in range(5):
        _, state = lavo_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], bases, pos_bias, state,
                                    window=w)
    state = {name: s.index_select(0, order) for name, s in state.items()}
    q, k, v = (x.index_select(0, order) for x in (q, k, v))
    full = lavo_attention(q, k, v, bases, pos_bias, window=w, causal=True, impl=impl)
    for t in range(5, n):
        out, state = lavo_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], bases, pos_bias,
                                      state, window=w)
        torch.testing.assert_close(out, full[:, :, t:t + 1], rtol=1e-10, atol=1e-10)


def cross_attention(q, k_src, v_src, bases, *, key_padding_mask=None):
    """LAVO cross-attention (§3.4) as the decoder runs it: the source memory, then the read-out (k_src unused)."""
    return lavo_cross_readout(q, *lavo_cross_memory(v_src, bases, key_padding_mask=key_padding_mask), bases)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("r", [3, D])
def test_lavo_cross_attention_matches_reference_with_source_padding(dtype, tol, r):
    n, s = 7, 10
    q, _, _, bases, _ = _inputs(n, 1, r)
    _, k_src, v_src, _, _ = _inputs(s, 1, r)
    mask = torch.zeros(B, s, dtype=torch.bool)
    mask[0, 6:] = True
    mask[1, :3] = True
    ref = lavo_cross_attention_reference(q, k_src, v_src, bases, key_padding_mask=mask)
    out = cross_attention(*(t.to(dtype) for t in (q, k_src, v_src, bases)), key_padding_mask=mask)
    assert out.shape == (B, H, n, D) and out.dtype == dtype
    assert rel_err(out.double(), ref) < tol
    v_pad = v_src.masked_fill(mask[:, None, :, None], 1e3)  # padded source values change nothing
    out_pad = cross_attention(q, k_src, v_pad, bases, key_padding_mask=mask)
    torch.testing.assert_close(out_pad, ref, rtol=1e-10, atol=1e-10)


def test_lavo_cross_attention_with_no_source_token_gives_zero():
    q, k_src, v_src, bases, _ = _inputs(5, 2, 4)
    mask = torch.zeros(B, 5, dtype=torch.bool)
    mask[1] = True
    for fn in (cross_attention, lavo_cross_attention_reference):
        out = fn(q, k_src, v_src, bases, key_padding_mask=mask)
        assert torch.isfinite(out).all() and out[1].abs().amax() == 0 and out[0].abs().amax() > 0


def test_lavo_init_bases_has_orthonormal_rows():
    for r in (3, D):
        bases = lavo_init_bases(H, r, D)
        assert bases.shape == (H, r, D)
        eye = torch.eye(r).expand(H, r, r)
        torch.testing.assert_close(bases @ bases.transpose(-1, -2), eye, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="num_bases"):
        lavo_init_bases(H, D + 1, D)


@pytest.mark.parametrize("change,match", [
    (dict(window=0), "window"),
    (dict(bases=torch.zeros(H, D + 1, D)), r"bases.*r <= D"),
    (dict(bases=torch.zeros(H + 1, 4, D)), r"bases.*\(H, r, D\)"),
    (dict(bases=torch.zeros(H, 4, D - 1)), r"bases.*\(H, r, D\)"),
    (dict(pos_bias=torch.zeros(H, 4)), r"pos_bias.*\(H, 2w-1\) = \(3, 7\)"),
    (dict(pos_bias=torch.zeros(H + 1, 7)), r"pos_bias.*\(H, 2w-1\)"),
    (dict(v=torch.zeros(B, H, 6, D + 2)), r"v must have the head dim D = 8"),
])
def test_lavo_rejects_bad_arguments(change, match):
    q, k, v, bases, pos_bias = _inputs(6, 4, 4, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, bases=bases, pos_bias=pos_bias, window=4)
    args.update(change)
    for fn in (lavo_attention, lavo_attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(args["q"], args["k"], args["v"], args["bases"], args["pos_bias"], window=args["window"])


def test_lavo_cross_attention_rejects_value_dim_mismatch():
    q = torch.randn(B, H, 4, D)
    with pytest.raises(ValueError, match="v_src must have the head dim"):
        lavo_cross_attention_reference(q, torch.randn(B, H, 5, D), torch.randn(B, H, 5, D + 1),
                                       lavo_init_bases(H, 4, D))
    with pytest.raises(ValueError, match="bases must have shape"):  # the memory checks v_src against the bases
        cross_attention(q, torch.randn(B, H, 5, D), torch.randn(B, H, 5, D + 1), lavo_init_bases(H, 4, D))


@pytest.mark.parametrize("b, m, k, j", [(3, 4, 12, 6), (3, 5, 12, 7), (5, 13, 33, 64)])
def test_memory_products_of_a_sequence_do_not_depend_on_its_batch(gen, b, m, k, j):
    """The memory's per-head products (window sums times the bases, LAVO eq. 3): one sequence alone gives the same
    numbers, bit for bit, as within a batch (float32 batched products at these shapes do not)."""
    from linattn.ops.lavo.memory import per_head

    x, w = torch.randn(b, 2, m, k, generator=gen), torch.randn(2, k, j, generator=gen)
    assert torch.equal(per_head(x, w)[1:2], per_head(x[1:2], w))
    torch.testing.assert_close(per_head(x, w), torch.einsum("bhmk,hkj->bhmj", x, w))

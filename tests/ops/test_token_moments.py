"""Each token row's moments for LLN's moment matching (``ops.token_moments``): the fused kernel
(``triton/token_moments.py``, run by Triton's interpreter) against float64 sums of the same half entries and their
count, in every layout the module hands it, padded rows (holding inf and NaN) all 0, and the moment matcher's alpha,
beta with ``--attention-impl fused`` against ``parallel``'s, padding left and right."""
import pytest
import torch
from helpers import LAYOUTS, padding_mask

from fairseq_linattn.modules.moment_matcher import MomentMatcher
from linattn import ops
from linattn_tools.benchmark.dispatch import count_dispatch

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def exact(q, k, mask=None):
    """(5,B,H,N) float64: the sums of the half entries, their squares, exactly, and D; 0 on a padded row."""
    q, k = q.double(), k.double()
    rows = torch.stack([q.sum(-1), k.sum(-1), q.square().sum(-1), k.square().sum(-1), torch.full(q.shape[:3], 1.0)
                        * q.shape[-1]])
    return rows if mask is None else rows.masked_fill(mask[:, None, :], 0.0)


def with_garbage(x, mask):
    """x with inf, NaN and a large value on its padded rows (what a padded row holds must not reach the sums)."""
    garbage = torch.tensor([float("inf"), float("nan"), -6e4], dtype=x.dtype)[torch.arange(x.shape[2]) % 3]
    return torch.where(mask[:, None, :, None], garbage[None, None, :, None], x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layouts", [("fairseq", "fairseq"), ("contiguous", "fairseq"), ("sliced", "contiguous")])
@pytest.mark.parametrize("n", [5, 77])
@pytest.mark.parametrize("side", [None, "left", "right"])
def test_fused_rows_are_the_sums_of_the_entries_their_squares_and_their_count(gen, dtype, layouts, n, side):
    """q and k on different scales (a sum of q's squares read from k shows), D = 20 (a masked block of 32; a count
    of 32 would show), rows across two programs; padded rows hold inf and NaN, and give 0 in every row."""
    q = (3 * torch.randn(2, 3, n, 20, generator=gen)).to(DTYPES[dtype])
    k = (0.5 * torch.randn(2, 3, n, 20, generator=gen) + 1).to(DTYPES[dtype])
    mask = None if side is None else padding_mask(2, n, side, gen)
    if mask is not None:
        q, k = with_garbage(q, mask), with_garbage(k, mask)
    laid = [LAYOUTS[name](t)[0] for name, t in zip(layouts, (q, k))]
    with count_dispatch() as counts:
        got = ops.token_moments(*laid, mask, impl="fused")
    assert counts.launched == 1 and got.dtype == torch.float32 and got.shape == (5, 2, 3, n)
    torch.testing.assert_close(got.double(), exact(q, k, mask), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("impl,dtype", [("parallel", torch.float16), ("looped", torch.bfloat16),
                                        ("auto", torch.float32), ("auto", torch.float64)])
@pytest.mark.parametrize("side", [None, "left"])
def test_the_other_implementations_and_dtypes_take_four_reductions(gen, impl, dtype, side):
    """The implementations without rows of their own are the reductions, float64 accumulating in float64; padded
    rows holding inf and NaN give 0. fused asked of inputs its kernels do not take (fp32, fp64) is refused, as
    LLN's op refuses them."""
    if impl == "auto":
        with pytest.raises(ValueError, match=f"dtype {dtype} not in"):
            ops.token_moments(torch.ones(1, 1, 2, 4, dtype=dtype), torch.ones(1, 1, 2, 4, dtype=dtype), impl="fused")
    q, k = (torch.randn(2, 2, 9, 8, generator=gen).to(dtype) for _ in range(2))
    mask = None if side is None else padding_mask(2, 9, side, gen)
    if mask is not None:
        q, k = with_garbage(q, mask), with_garbage(k, mask)
    with count_dispatch() as counts:
        got = ops.token_moments(q, k, mask, impl=impl)
    assert counts.ops["token_moments"] == 0
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got.double(), exact(q, k, mask), **tol)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_matcher_with_the_fused_rows_matches_parallel(gen, side, per_head):
    """alpha, beta (training statistics of a padded half batch, per head and per layer): the kernel's float32 sums
    of squares against the reductions' squared norms differ only by float32 rounding."""
    q = (2 * torch.randn(2, 4, 33, 16, generator=gen)).half()
    k = (0.7 * torch.randn(2, 4, 33, 16, generator=gen)).half()
    mask = padding_mask(2, 33, side, gen)
    got = []
    for impl in ("fused", "parallel"):
        with count_dispatch() as counts:
            got.append(MomentMatcher(head_dim=16, num_heads=4, per_head=per_head, impl=impl).train()(q, k, mask))
        assert counts.ops["token_moments"] == (impl == "fused")
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


def test_matcher_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="impl must be one of auto, parallel, looped, fused"):
        MomentMatcher(head_dim=16, impl="triton")


@pytest.mark.parametrize("impl", ["auto", "parallel", "fused"])
def test_the_rows_compile_whole(gen, impl):
    """Choosing the implementation breaks no graph (the model's ``--attention-compile`` traces the matcher)."""
    q, k = (torch.randn(2, 3, 11, 8, generator=gen).half() for _ in range(2))
    mask = padding_mask(2, 11, "right", gen)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, m: ops.token_moments(q, k, m, impl=impl), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, mask), ops.token_moments(q, k, mask, impl=impl), rtol=0, atol=0)

"""``linattn.compile_shapes``: what ``--attention-compile`` makes symbolic. One graph serves new batch sizes, query
lengths and key lengths; a new head count or head size is a new graph (they are constants of a module)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from linattn import ops
from linattn.compile_shapes import compile_varying_lengths


def masked_attention(q, k, v, key_padding_mask):
    """Softmax attention of q (B, H, T, D) over k, v (B, H, S, D), padded keys (B, S) left out."""
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf")).softmax(-1) @ v


def call(fn, b, h, t, s, d, gen):
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, : s // 3] = True  # left padding in one sequence
    torch.testing.assert_close(fn(q, k, v, mask), masked_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_batch_and_lengths_share_one_graph_heads_and_head_size_do_not(gen):
    torch._dynamo.reset()
    counters.clear()
    fn = compile_varying_lengths(masked_attention, backend="eager", fullgraph=True)
    for b, t, s in ((2, 5, 7), (3, 6, 9), (4, 8, 8), (2, 11, 3)):
        call(fn, b, 3, t, s, 4, gen)
    assert counters["stats"]["unique_graphs"] == 1, "a new batch size or length recompiled"
    call(fn, 2, 5, 5, 7, 4, gen)
    call(fn, 3, 5, 6, 9, 4, gen)
    assert counters["stats"]["unique_graphs"] == 2, "the head count is not a constant of the graph"
    call(fn, 2, 5, 5, 7, 8, gen)
    assert counters["stats"]["unique_graphs"] == 3, "the head size is not a constant of the graph"


def test_keyword_arguments_are_marked_too(gen):
    torch._dynamo.reset()
    counters.clear()
    fn = compile_varying_lengths(lambda q, k, v, key_padding_mask: masked_attention(q, k, v, key_padding_mask),
                                 backend="eager", fullgraph=True)
    for b, n in ((2, 5), (3, 9)):
        q, k, v = (torch.randn(b, 2, n, 4, generator=gen) for _ in range(3))
        mask = torch.zeros(b, n, dtype=torch.bool)
        torch.testing.assert_close(fn(q, k, v, key_padding_mask=mask), masked_attention(q, k, v, mask))
    assert counters["stats"]["unique_graphs"] == 1


def _lln_diag(causal):
    return lambda q, k, v, mask: ops.lln_diag_attention(q, k, v, 1.2, 0.7, block_size=4, chunk_size=4, causal=causal,
                                                        key_padding_mask=mask, impl="parallel")


def _lavo(causal):
    bases = torch.eye(4)[:3].expand(3, 3, 4)  # 3 heads' 3 orthonormal rows in D = 4
    pos_bias = torch.linspace(-1.0, 1.0, 3 * 7).reshape(3, 7)  # (H, 2w - 1)
    return lambda q, k, v, mask: ops.lavo_attention(q, k, v, bases, pos_bias, window=4, causal=causal,
                                                    key_padding_mask=mask, impl="parallel")


GRID_OPS = {  # ops whose parallel form pads the length to a grid of 4 (chunks, blocks or windows)
    "lln causal": lambda q, k, v, mask: ops.lln_attention(q, k, v, 1.2, 0.7, causal=True, chunk_size=4,
                                                          key_padding_mask=mask, impl="parallel"),
    "lln_diag": _lln_diag(False),
    "lln_diag causal": _lln_diag(True),
    "block_softmax causal": lambda q, k, v, mask: ops.block_softmax_attention(
        q, k, v, block_size=4, causal=True, key_padding_mask=mask, impl="parallel"),
    "lavo": _lavo(False),
    "lavo causal": _lavo(True),
}


# LLN+Diag's causal form pads to the chunks and the blocks (causal LLN's and the block softmax's pads), LAVO's to its
# windows: those two in the default tier, the other four (seconds of tracing each) in the extended tier
DEFAULT_GRID_OPS = ("lln_diag causal", "lavo causal")


@pytest.mark.parametrize("name", [n if n in DEFAULT_GRID_OPS else pytest.param(n, marks=pytest.mark.extended)
                                  for n in GRID_OPS])
def test_lengths_on_and_off_the_grid_share_one_graph(name, gen):
    """The chunked, blocked and windowed forms pad N to a multiple of their size (4 here); compiled, that pad is
    traced even when it is 0 rows (``batched.chunks``), and the output sliced back from the padded rows is copied
    contiguous (``precision.function_output``), so a length on the grid (12) does not recompile what a length off
    it (9) compiled: Dynamo would otherwise guard on the pad being 0 or on the slice being contiguous."""
    torch._dynamo.reset()
    counters.clear()
    op = GRID_OPS[name]
    fn = compile_varying_lengths(op, backend="eager", fullgraph=True)
    for n in (9, 12, 7):
        q, k, v = (torch.randn(2, 3, n, 4, generator=gen) for _ in range(3))
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, : n // 3] = True
        torch.testing.assert_close(fn(q, k, v, mask), op(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, "a length on the grid recompiled"

"""Every fused custom op (``linattn::*``, forward and backward) as each method calls it with q, k, v in fairseq's
layout and a padding mask, checked by ``torch.library.opcheck``: its schema, and its fake (meta) implementation
against the kernels run by Triton's interpreter: shapes, dtypes and strides. ``torch.compile`` and the meta device
plan with the fake outputs' strides: a real output laid out otherwise (as LAVO's was: contiguous from fairseq's
layout, its fake in fairseq's) breaks what a compiled graph assumes."""
import pytest
import torch
from helpers import fairseq_layout, padding_mask, siblings_layout
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_linattn.modules.moment_matcher import MomentMatcher
from linattn import ops

pytest.importorskip("triton", minversion="3.9")  # runtime loop bounds in the interpreter (triton/common.py)

ALPHA = torch.tensor([1.3, 0.7]).view(1, 2, 1, 1)


class CustomOpCalls(TorchDispatchMode):
    """Records each ``linattn::`` op call (op, args, kwargs) made under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "linattn":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def run(method, causal, q, k, v, mask, gen):
    """One forward and backward of ``method``'s fused implementation (a forward of the moment rows)."""
    if method == "token_moments":  # LLN's moment matching: no gradient
        ops.token_moments(q, k, mask, impl="fused")
        return
    if method == "moment_matcher":  # its scales and the fold of the batch into its EMA after the token sums
        MomentMatcher(head_dim=q.shape[-1], num_heads=2, per_head=True, stats="ema", impl="fused").train()(q, k, mask)
        return
    if method == "lln":
        out = ops.lln_attention(q, k, v, ALPHA, 0.9, causal=causal, key_padding_mask=mask, chunk_size=8, impl="fused")
    elif method == "lln_diag":
        out = ops.lln_diag_attention(q, k, v, ALPHA, 0.9, block_size=8, chunk_size=8, causal=causal,
                                     key_padding_mask=mask, impl="fused")
    elif method == "skyformer":
        out = ops.skyformer_attention(q, k, v, key_padding_mask=mask, num_landmarks=6, training=False, impl="fused")
    else:
        bases = (torch.randn(2, 6, q.shape[-1], generator=gen) * 0.4).half()
        out = ops.lavo_attention(q, k, v, bases, torch.zeros(2, 7), window=4, causal=causal, key_padding_mask=mask,
                                 impl="fused", real_first=not causal)  # non-causal: the rows read through an order
    out.backward(torch.randn(out.shape, generator=gen).half())


CASES = [("lln", False), ("lln", True), ("lln_diag", False), ("lln_diag", True), ("skyformer", False), ("lavo", False),
         ("lavo", True), ("token_moments", False), ("moment_matcher", False)]
# Skyformer's and LAVO's ops take seconds each under the interpreter: each in one layout in the default tier (LAVO's
# two causalities in different ones), in the other in the extended tier
OTHER_LAYOUT = {("skyformer", False): "fairseq", ("lavo", False): "siblings", ("lavo", True): "fairseq"}


@pytest.mark.parametrize("method, causal, layout", [
    pytest.param(*case, layout, marks=pytest.mark.extended) if OTHER_LAYOUT.get(case) == layout else (*case, layout)
    for layout in ("fairseq", "siblings") for case in CASES])
def test_fused_ops_fake_outputs_match_the_kernels(gen, method, causal, layout):
    """siblings: q, k, v packed as the module packs them, whose gradients the backward ops return packed."""
    qkv = [torch.randn(2, 2, 13, 12, generator=gen).half() for _ in range(3)]
    q, k, v = (t.requires_grad_() for t in (fairseq_layout(*qkv) if layout == "fairseq" else siblings_layout(*qkv)))
    mask = None if causal else padding_mask(2, 13, "left", gen)
    with CustomOpCalls() as seen:
        run(method, causal, q, k, v, mask, gen)
    assert len(seen.calls) >= 1 + (method != "token_moments"), [str(c[0]) for c in seen.calls]  # forward, backward
    if method == "moment_matcher":
        # the batch's sums, then the EMA's value from before the batch and the sums folded in, in one launch
        assert [c[0].__name__ for c in seen.calls] == ["token_moments.default", "lln_scales_recorded.default"]
    for op, args, kwargs in seen.calls:
        torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))

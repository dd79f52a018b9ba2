"""The moment matcher's batch statistics (``MomentMatcher._moments``): sums of q, k and of their squares over the
non-padded tokens. Each token row is reduced over D in float32 straight from fp16/bf16 (float64 for float64 q, k),
and the rows are summed over the tokens in float64: the sums match a float64 computation from the same values, a
padded row adds nothing whatever it holds, and no op makes a full-size upcast copy of q or k (a float64 copy of each
moved ~10x the bytes of q and k on an H100 training step)."""
import pytest
import torch
from helpers import padding_mask
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fairseq_linattn.modules.moment_matcher import MomentMatcher

F64 = torch.float64


def _reference(q, k, mask, per_head, per_sequence):
    """(5, G) or (5, B, G) in float64 from q, k's values, and the same sums of |x| (the scale of rounding errors)."""
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if mask is None else ~mask
    dims = (2, 3) if per_head else (1, 2, 3)
    dims, shape = (dims, (q.shape[0], -1)) if per_sequence else ((0,) + dims, (-1,))
    rows, scale = [], []
    for power in (1, 2):
        for x in (q, k):
            x = torch.where(keep[:, None, :, None], x.double(), 0.0) ** power
            rows.append(x.sum(dims).reshape(shape))
            scale.append(x.abs().sum(dims).reshape(shape))
    count = keep[:, None, :, None].expand(q.shape).to(F64).sum(dims).reshape(shape)
    return torch.stack([*rows, count]), torch.stack([*scale, count])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, F64])
@pytest.mark.parametrize("side", [None, "left", "right"])
@pytest.mark.parametrize("per_head", [False, True])
def test_moments_match_float64_sums_of_the_input_values(gen, dtype, side, per_head):
    B, H, N, D = 4, 3, 37, 64
    q = (1.7 * torch.randn(B, H, N, D, generator=gen, dtype=F64) + 0.4).to(dtype)
    k = (0.6 * torch.randn(B, H, N, D, generator=gen, dtype=F64) - 0.1).to(dtype)
    mask = None if side is None else padding_mask(B, N, side, gen)
    if mask is not None:  # padded rows hold garbage (an overflow, NaN): it must not reach the sums
        pad = mask[:, None, :, None]
        garbage = torch.tensor([float("inf"), float("nan"), -6e4])[torch.arange(N) % 3][None, None, :, None]
        q, k = torch.where(pad, garbage.to(dtype), q), torch.where(pad, -garbage.to(dtype), k)
    matcher = MomentMatcher("paper", head_dim=D, num_heads=H, per_head=per_head)
    tol = 1e-12 if dtype == F64 else 1e-6
    for per_sequence in (False, True):
        got = matcher._moments(q, k, mask, per_sequence=per_sequence)
        want, scale = _reference(q, k, mask, per_head, per_sequence)
        assert got.dtype == F64 and got.shape == want.shape
        assert got.shape == ((5, B, H if per_head else 1) if per_sequence else (5, H if per_head else 1))
        assert torch.equal(got[4], want[4])
        err = ((got - want).abs() / scale.clamp_min(1e-300)).max().item()
        assert err <= tol, f"relative error {err:.3g} > {tol:g} (per_sequence={per_sequence})"


class _OpSizes(TorchDispatchMode):
    """Each non-view aten op's name and the bytes of its largest output, and the bytes all of them read and wrote."""

    def __init__(self):
        super().__init__()
        self.outputs, self.traffic = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            nbytes = [t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.outputs.append((str(func), max(nbytes, default=0)))
            self.traffic += sum(nbytes) + sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs))[0]
                                              if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_moments_make_no_full_size_copy_of_q_or_k(per_head, padded):
    """On the meta device at the H100 benchmark's shape: no op outputs a tensor as large as q itself (let alone an
    fp32/fp64 copy), and the ops move less than 4x the bytes of q and k (the float64 copies moved over 25x)."""
    B, H, N, D = 8, 12, 4096, 64
    q, k = (torch.empty(B, H, N, D, dtype=torch.float16, device="meta") for _ in range(2))
    mask = torch.zeros(B, N, dtype=torch.bool, device="meta") if padded else None
    matcher = MomentMatcher("paper", head_dim=D, num_heads=H, per_head=per_head).to("meta")
    for per_sequence in (False, True):
        with _OpSizes() as probe:
            matcher._moments(q, k, mask, per_sequence=per_sequence)
        too_large = [(op, n) for op, n in probe.outputs if n >= q.numel() * q.element_size()]
        assert not too_large, f"full-size tensors made (op, bytes): {too_large}"
        assert probe.traffic < 4 * 2 * q.numel() * q.element_size(), f"{probe.traffic / 2**20:.0f} MiB moved"

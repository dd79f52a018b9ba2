"""What the tests share (fixtures and pytest options are in conftest.py): the repository root, error measures,
padding masks, fairseq's layout, a value-and-gradient comparison, a probe of the largest tensor an op makes, and a
venv with torch 2.11 (a GPU machine's torch and Triton)."""
import fcntl
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
FILL_ENV = "LINATTN_FILL_UNINITIALIZED"  # =1: as ``--fill-uninitialized`` (conftest.py)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def padding_mask(batch: int, n: int, side: str, generator=None) -> torch.Tensor:
    """(B, N) bool, True = padding; row 0 unpadded, the others padded on `side` by random amounts < N."""
    mask = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(1, batch):
        p = int(torch.randint(1, max(n, 2), (1,), generator=generator)) if n > 1 else 0
        if side == "left":
            mask[b, :p] = True
        else:
            mask[b, n - p:] = True
    return mask


def padded_row_against_alone(fn, gen, n, left, right, causal, dtype=torch.float64):
    """fn(q, k, v, causal, mask) on one row of n tokens, alone and with ``left`` and ``right`` padded tokens (huge
    entries): (output, gradients) of the real tokens, each way, the output gradient 0 on padding (as a model's
    loss sends it)."""
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    grad = torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64).to(dtype)
    pad = lambda t, fill: torch.cat([t.new_full((1, 2, left, 8), fill), t, t.new_full((1, 2, right, 8), fill)], 2)
    mask = torch.zeros(1, left + n + right, dtype=torch.bool)
    mask[:, :left], mask[:, left + n:] = True, True
    results = []
    for args, m, g in (((q, k, v), None, grad), ((pad(q, 3.0), pad(k, 1e3), pad(v, -1e3)), mask, pad(grad, 0.0))):
        leaves = [t.clone().requires_grad_() for t in args]
        out = fn(*leaves, causal=causal, mask=m)
        grads = torch.autograd.grad(out, leaves, g)
        real = slice(0, n) if m is None else slice(left, left + n)
        results.append((out[:, :, real], *(d[:, :, real] for d in grads)))
    return results


def fairseq_layout(*tensors: torch.Tensor):
    """(B,H,T,D) tensors laid out as fairseq's (T,B,H,D) projections seen as (B,H,T,D): no row is contiguous."""
    return tuple(t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in tensors)


def sliced_layout(*tensors: torch.Tensor):
    """(B,H,T,D) tensors whose rows are 2D apart (the first half of a wider tensor): a layout the fused kernels copy."""
    out = []
    for t in tensors:
        wide = t.new_zeros(*t.shape[:3], 2 * t.shape[3])
        wide[..., :t.shape[3]] = t
        out.append(wide[..., :t.shape[3]])
    return tuple(out)


def packed_layout(*tensors: torch.Tensor, slot: int = 1):
    """(B,H,T,X) tensors each in ``slot`` of three side by side in each head, (T,B,H,3X) memory, as the module's packed
    projection lays out q, k and v (head stride 3X; the other slots hold other numbers)."""
    out = []
    for t in tensors:
        b, h, n, x = t.shape
        wide = torch.full((n, b, h, 3 * x), 7.0, dtype=t.dtype)
        wide[..., slot * x:(slot + 1) * x] = t.permute(2, 0, 1, 3)
        out.append(wide[..., slot * x:(slot + 1) * x].permute(1, 2, 0, 3))
    return tuple(out)


def siblings_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k (B,H,T,D) and v (B,H,T,Dv) as views of one (T,B,H,2D+Dv) tensor, each head's q, k, v side by side: the
    module's packed projection (``fairseq_linattn.modules.base``, ``linattn.ops.packed_heads``)."""
    d = q.shape[-1]
    packed = torch.cat([t.permute(2, 0, 1, 3) for t in (q, k, v)], -1)
    return tuple(packed[..., a:b].permute(1, 2, 0, 3) for a, b in ((0, d), (d, 2 * d), (2 * d, packed.shape[-1])))


LAYOUTS = {"fairseq": fairseq_layout, "contiguous": lambda t: (t.contiguous(),), "sliced": sliced_layout}


def check_fused_layouts(run, leaves, grad, layouts, packed_grads: bool = True) -> None:
    """``run(q, k, v)`` of a fused op with q, k, v and dL/d(out) laid out as ``layouts`` (names of ``LAYOUTS``, in that
    order) gives the output and gradients of contiguous ``leaves`` (q, k, v) and ``grad``, bit for bit; the output and
    every gradient come in q's layout where the kernels read q in place (fairseq's or contiguous: then the module's
    head merge and the projections' backward copy nothing), contiguous otherwise (sliced); for ``siblings`` (q, k, v
    packed as the module's projection packs them: read in place) the output in fairseq's own layout and dq, dk, dv
    views of one tensor, laid out as q, k, v are (unless not ``packed_grads``: Skyformer's landmarks, rows of q and
    k, add their gradients to dq and dk outside the op)."""
    out = run(*leaves)
    want = torch.autograd.grad(out, leaves, grad)
    if layouts[0] == "siblings":
        moved = [t.requires_grad_() for t in siblings_layout(*(t.detach() for t in leaves))]
    else:
        moved = [LAYOUTS[name](t.detach())[0].requires_grad_() for name, t in zip(layouts, leaves)]
    got_out = run(*moved)
    got = torch.autograd.grad(got_out, moved, LAYOUTS[layouts[3]](grad)[0])
    assert torch.equal(got_out, out) and all(torch.equal(a, b) for a, b in zip(got, want))
    kind = LAYOUTS[{"sliced": "contiguous", "siblings": "fairseq"}.get(layouts[0], layouts[0])]
    assert got_out.stride() == kind(out.detach())[0].stride(), layouts
    if layouts[0] == "siblings" and packed_grads:  # dq, dk, dv: views of one tensor laid out as q, k, v are
        assert [g.stride() for g in got] == [t.stride() for t in moved], layouts
        assert len({g.untyped_storage().data_ptr() for g in got}) == 1
        assert [g.storage_offset() for g in got] == [t.storage_offset() for t in moved]
        return
    if layouts[0] == "siblings":
        return
    for answer, like in zip(got, leaves):
        assert answer.stride() == kind(like.detach())[0].stride(), layouts


# q, k, v and dL/d(out): all in fairseq's layout, and mixes that tell one tensor's strides from another's
# (and the module's packed q, k, v; a tensor packed apart from the others is copied, test_triton_common)
LAYOUT_CASES = [("fairseq",) * 4, ("fairseq", "contiguous", "fairseq", "sliced"),
                ("sliced", "fairseq", "contiguous", "fairseq"), ("siblings",) * 3 + ("fairseq",)]


def assert_same_values_and_grads(out, ref, inputs, generator, rtol=1e-8, atol=1e-9) -> None:
    """out == ref (float64 tolerances), and so are their gradients w.r.t. ``inputs`` for one random output grad."""
    torch.testing.assert_close(out, ref, rtol=rtol * 0.1, atol=atol * 0.1)
    g = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces, to prove an op never materialises N×N."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


# torch 2.11.0 from PyPI (a 4.6 GB CUDA build; it runs on the CPU) beside this venv's other packages, for the extended
# tier: kept in a cache outside the clone (LINATTN_CACHE, else ~/.cache/fairseq_linattn), so that later clones and runs
# on the same machine reuse it; a bare machine makes it on first use
CACHE = Path(os.environ.get("LINATTN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                     "fairseq_linattn"))
TORCH_211_VENV = CACHE / ("venv-torch2.11-py%d.%d" % sys.version_info[:2])


def torch_211_python() -> Path:
    """A venv with torch 2.11.0 (and the Triton 3.6 it ships with) that sees this venv's other packages (a .pth after
    its own site-packages); made on first use (slow tier)."""
    python = TORCH_211_VENV / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "venv-torch2.11.lock", "w") as lock:  # pytest-xdist: one worker makes it, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (TORCH_211_VENV / ".installed").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(TORCH_211_VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "torch==2.11.0"], check=True, timeout=1800)
            (TORCH_211_VENV / ".installed").touch()
        site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
        Path(site, "zz_linattn_project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def compiled_op_count(fn, args, op_name: str) -> int:
    """Compile ``fn`` whole (``fullgraph``; a backend that keeps Dynamo's graphs and runs them as traced), check that
    it gives ``fn(*args)`` bit for bit, and count the nodes calling the custom op ``linattn::<op_name>`` in its graphs
    (looked up after the call, which registers it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    assert torch.equal(compiled(*args), fn(*args))
    target = getattr(torch.ops.linattn, op_name).default
    return sum(node.target is target for gm in graphs for node in gm.graph.nodes)


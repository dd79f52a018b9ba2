"""Fixtures and pytest options of the tests (what they share besides: helpers.py)."""
import dataclasses
import os

# Triton's interpreter runs the fused kernels on CPU tensors (tests/ops/test_lln_fused.py). Triton reads this once,
# when it is first imported, which another test's torch.compile may do first: set here, before any test module.
os.environ["TRITON_INTERPRET"] = "1"
# pytest-xdist (scripts/run_tests.sh starts a worker a core): a worker's torch and the processes its tests start take
# its share of the cores, not all of them each (OpenMP threads beyond the cores spin against each other)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import FILL_ENV  # noqa: E402

if WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def gen():
    """A generator with a fresh seed each run (printed, so a failure can be replayed)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed())))
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def mc_gen():
    """A fixed seed for Monte-Carlo tests, whose tolerances are statistical: a fresh seed would make them
    fail now and then by chance (exactness tests use ``gen``, a fresh seed every run)."""
    return torch.Generator().manual_seed(20261123)


# -- uninitialised memory: ``--fill-uninitialized`` (or LINATTN_FILL_UNINITIALIZED=1) turns on, for the whole
# session, torch's deterministic mode with ``fill_uninitialized_memory``: every tensor made by ``empty`` /
# ``new_empty`` starts as NaN (integers: their largest value), so a read of a buffer no op has written shows
# as a NaN output or gradient (tests/ops/test_uninitialized_memory.py runs the op tests this way).


def pytest_addoption(parser):
    parser.addoption("--fill-uninitialized", action="store_true", default=False,
                     help="torch.use_deterministic_algorithms(True) with fill_uninitialized_memory: new empty "
                          f"tensors hold NaN (also set by {FILL_ENV}=1)")


def pytest_configure(config):
    if config.getoption("--fill-uninitialized") or os.environ.get(FILL_ENV) == "1":
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    without_overflow_sums()


def without_overflow_sums() -> None:
    """Triton's interpreter follows every int32 add, sub and mul of a kernel with the same operation in int64 and
    two comparisons (``sanitize_overflow``) for a device assertion that it then drops (``device_assert`` asserts
    only under ``debug``, off in the interpreter's options): about 40% of an interpreted kernel's time for nothing.
    Off for the tests' session, unless the options ask for ``debug`` (then the assertions are made)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no Triton: nothing interpreted
        return
    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    patch_lang_once(interpreter, tl)


def patch_lang_once(interpreter, tl) -> None:
    """Triton's interpreter patches ``triton.language`` (each builtin of the module, its tensor and math, found by
    ``inspect.getmembers``) when a kernel's grid starts, and again, the same way, at every call of a jit function
    inside the kernel (``tl.sum`` and the like patch ``triton.language.core``): about a third of an interpreted
    kernel's time. Here a call inside a grid skips the patch when the modules its function sees are already patched
    in that grid; the grid's own patch and its restore are as before."""
    original, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    grids = []  # per running grid: the ids of the language modules patched in it so far

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if grids and langs and langs <= grids[-1]:
            return interpreter._LangPatchScope()
        scope = original(fn)
        if grids:
            grids[-1].update(langs)
        return scope

    def run_grid(self, *args, **kwargs):
        grids.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            grids.pop()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, run_grid

"""The one table of how far an attention's output and gradients may be from the float64 reference, per input
dtype: the tests and the GPU self-test read it (``tolerance``). Relative error ||got - ref|| / ||ref||.

Half inputs compute in float32 inside the linear ops and round the result; softmax runs SDPA's half-precision
kernels. TF32 follows PyTorch's global switches (``torch.backends.cuda.matmul.allow_tf32``), as for the rest of the
model: with TF32 on, float32 results carry about bf16-level matmul rounding, so the self-test turns it off.
"""
from linattn.methods import METHODS

RELATIVE_ERROR = {"float64": 1e-10, "float32": 2e-4, "float16": 5e-3, "bfloat16": 3e-2}
GRADIENT_FACTOR = 2.0  # gradients round through one more product than the output


def tolerance(method: str, dtype: str, *, gradient: bool = False) -> float:
    """The largest relative error accepted for ``method`` (a registry name) with ``dtype`` ("bfloat16", ...) inputs;
    methods whose computation amplifies rounding (Skyformer's Nyström inverse) scale it by their rounding gain."""
    base = RELATIVE_ERROR[dtype] * METHODS[method].rounding_gain
    return base * GRADIENT_FACTOR if gradient else base

"""What the Triton kernels share: launch sizes, the half dtypes, and a tensor-core product of bounded operands.

Loops over a runtime length are ``while`` loops: Triton 3.6's interpreter cannot take a runtime bound in
``range`` with NumPy >= 2.4 (fixed in Triton 3.9); compiled, both are loops of the same trip count.
"""
import os

import torch
import triton
import triton.language as tl

HALF = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # the input dtypes the kernels take
TINY = tl.constexpr(1e-30)  # the smallest denominator, as ``lln/features._TINY`` (a constexpr: kernels read it)


def block(n: int) -> int:
    """The power-of-two block (>= 16, the smallest tensor-core tile) that holds n rows or columns."""
    return max(16, triton.next_power_of_2(n))


def emulate_half_dot(dtype: torch.dtype) -> bool:
    """Whether ``half_dot`` multiplies its rounded operands in fp32: under Triton's interpreter (3.6 to 3.9 at
    least) a bf16 ``tl.dot`` multiplies the raw bits as integers; a product of two halves is exact in fp32."""
    return os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16


@triton.jit
def half_dot(a, b, HALF_TY: tl.constexpr, EMULATE: tl.constexpr):
    """a (M,K) @ b (K,N) with both rounded to HALF_TY (tensor cores on a GPU), accumulated in fp32; for operands
    bounded in magnitude (features <= 1 after their shifts, values as given)."""
    a = a.to(HALF_TY)
    b = b.to(HALF_TY)
    if EMULATE:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, out_dtype=tl.float32)

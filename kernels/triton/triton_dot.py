"""The matrix-multiply step the attention kernels share, and how precise it must be.

Triton's CPU interpreter computes bfloat16 `tl.dot` wrongly (numpy has no bfloat16: the raw
bits are multiplied), so under TRITON_INTERPRET=1 the operands are widened to float32 first.
The values were already rounded to their storage dtype, so the result matches the GPU's
bfloat16 MMA up to accumulation order. (The interpreter also truncates float32 → bfloat16
casts where a GPU rounds to nearest: interpreter tests use tolerances of one bf16 ulp.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs keep full precision (tf32 would drift from the reference); 16-bit use MMA."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must widen dot operands to float32 (interpreter with 16-bit inputs)."""
    return interpreting() and dtype != torch.float32


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)

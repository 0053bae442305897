"""Triton SiLU-and-mul (SwiGLU gate): silu(x[..., :d]) * x[..., d:] in one pass, in float32,
without materialising silu(gate) as torch does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:]."""
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {two_d}")
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), d, d, BLOCK=block
        )
    return out

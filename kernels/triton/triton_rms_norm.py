"""Triton fused RMSNorm with an optional residual add: one read of x (and residual), one write
of each output, instead of torch's separate add, square, mean, rsqrt and multiply passes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_SUM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    if WRITE_SUM:
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    inv = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight in x's dtype, x + residual in float32) — the reference's
    contract: the residual stream stays float32."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({hidden},)")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"rms_norm: residual shape {tuple(residual.shape)} != {tuple(x.shape)}"
            )
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    else:
        r2 = x2  # unused: HAS_RESIDUAL is a compile-time False
    # Without a residual a float32 x already is the float32 stream (as x.float() returns x).
    write_sum = residual is not None or x.dtype != torch.float32
    summed = torch.empty(x.shape, dtype=torch.float32, device=x.device) if write_sum else x
    rows = x2.shape[0]
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            summed,
            eps,
            x2.stride(0),
            r2.stride(0),
            hidden,
            hidden,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
            WRITE_SUM=write_sum,
        )
    return out, summed

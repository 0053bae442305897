"""Triton rotary position embedding for q and k, neox (half-split) and GPT-J (interleaved)
layouts, partial rotary (rotary_dim < head_dim) included.

Writes fresh output tensors rather than rotating in place, so the dispatch keeps the reference's
contract (inputs untouched) — the model may hold q/k as views of one fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cache_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cache,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    src = x_ptr + token * stride_xt + head * stride_xh
    dst = out_ptr + token * stride_ot + head * stride_oh
    # Dimensions past the rotary part pass through unchanged.
    offs_d = tl.arange(0, D_PAD)
    tail = (offs_d >= 2 * HALF) & (offs_d < HEAD_DIM)
    tl.store(dst + offs_d, tl.load(src + offs_d, mask=tail), mask=tail)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        i1 = offs
        i2 = offs + HALF
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    x1 = tl.load(src + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + i1, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + i2, (x2 * cos + x1 * sin).to(ty), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, is_neox: bool):
    tokens, heads, head_dim = x.shape
    half = cache.shape[-1] // 2
    if 2 * half > head_dim:
        raise ValueError(f"rotary_embedding: rotary_dim {2 * half} > head_dim {head_dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens and heads:
        _rotary_kernel[(tokens, heads)](
            x,
            out,
            positions,
            cache,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cache.stride(0),
            HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            IS_NEOX=is_neox,
        )
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([tokens, heads, D]) and k ([tokens, kv_heads, D]) by their positions.

    cos_sin_cache: [max_position, rotary_dim], cos in the first half, sin in the second."""
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    return (
        _rotate(query, positions, cos_sin_cache, is_neox),
        _rotate(key, positions, cos_sin_cache, is_neox),
    )

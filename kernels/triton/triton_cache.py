"""Triton reshape_and_cache: scatter this step's new K and V rows into their paged cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvfleet.kernels import reference


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_h,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per token: its kv_heads × head_dim values are one flat row.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < NUM_KV_HEADS * HEAD_DIM
        h = offs // HEAD_DIM
        d = offs % HEAD_DIM
        t = token.to(tl.int64)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        dst = slot * stride_cache_slot + h * stride_cache_h + d
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value ([tokens, kv_heads, head_dim]) into the caches at `slot_mapping` (-1 skips)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # fp8 caches: quantised by torch, copied by the kernel (Triton's interpreter converts some
    # float32 values to fp8 wrongly, so an in-kernel cast could not be checked here).
    key, value = reference.rows_for_cache(key, value, k_cache.dtype)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("reshape_and_cache: key/value head_dim must be contiguous (stride 1)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("reshape_and_cache: k_cache/v_cache must be contiguous")
    # Slot s lives at block s // block_size, offset s % block_size: in a contiguous
    # [blocks, block_size, ...] cache that is just row s of the flattened cache.
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
    )

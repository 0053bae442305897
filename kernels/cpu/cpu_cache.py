"""`reshape_and_cache` for the CPU path in C (kernels/cpu/cpu_cache.c): new K/V rows memcpy'd into
the head-major paged cache. Inputs it cannot take go to the torch reference."""

from __future__ import annotations

import torch
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import cpu_library


def _heads_packed(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def supports(key, value, k_cache, v_cache, slot_mapping) -> bool:
    return (
        key.device.type == value.device.type == k_cache.device.type == "cpu"
        and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.shape == v_cache.shape
        and key.shape == value.shape
        and key.shape[1:] == (k_cache.shape[2], k_cache.shape[3])
        and _heads_packed(key)
        and _heads_packed(value)
        and reference._is_head_major(k_cache)
        and reference._is_head_major(v_cache)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == key.shape[0]
        and cpu_library.available()
    )


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """`reference.reshape_and_cache`: write [tokens, kv_heads, D] K/V into their slots; slot
    -1 is skipped, a slot past the cache raises IndexError."""
    key, value = reference.rows_for_cache(key, value, k_cache.dtype)
    if not supports(key, value, k_cache, v_cache, slot_mapping):
        reference.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    status = cpu_library.library().kvfleet_reshape_and_cache(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        kv_heads,
        head_dim,
        block_size,
        num_blocks,
        key.element_size(),
    )
    if status == 2:
        raise IndexError(f"reshape_and_cache: a slot is past the cache ({num_blocks * block_size})")
    if status != 0:
        raise RuntimeError(f"CPU reshape_and_cache kernel: unsupported shape (status {status})")

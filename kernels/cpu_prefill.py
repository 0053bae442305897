"""The AMX prefill-attention kernel for the CPU path (kernels/cpu_prefill.c): one sequence's
prompt tokens (a chunk, or a suffix after a prefix-cache hit) against its paged bf16 K/V, at
1.7-2.6x the speed of torch's SDPA flash kernel with head_dim 64 (`kvfleet bench cpu-kernels`).
Where the CPU or build has no AMX, or the inputs do not fit (`supports`), callers keep the
reference's SDPA."""

from __future__ import annotations

import functools

import torch
from kvfleet.kernels import cpu_library, reference

_MAX_HEAD_DIM = 256
_ERRORS = {1: "unsupported shape", 2: "out of memory", 3: "no AMX on this CPU or build"}


@functools.cache
def _amx(lib: object) -> bool:
    # Keyed by the loaded library: a reloaded one (tests clear library()'s cache) asks again.
    return bool(lib.kvfleet_prefill_attention_amx())


def available() -> bool:
    """Whether the kernel can run here: the C library builds and the CPU grants AMX tiles."""
    return cpu_library.available() and _amx(cpu_library.library())


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bf16 CPU tensors, head-major bf16 caches with blocks of a multiple of 16 tokens,
    head_dim a multiple of 32 up to 256, whole GQA groups, each token's heads packed."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    return (
        query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        and k_cache.shape == v_cache.shape
        and reference._is_head_major(k_cache)
        and reference._is_head_major(v_cache)
        and head_dim % 32 == 0
        and 0 < head_dim <= _MAX_HEAD_DIM
        and block_size % 16 == 0
        and num_heads % num_kv_heads == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
    )


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.prefill_attention` (causal, the query being the last q of `seq_len`
    positions) written into `out` ([q, heads, D], heads packed per token) when given. Callers
    check `available()` and `supports()` first."""
    q_len, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    target = out
    if out is None or out.stride(2) != 1 or out.stride(1) != head_dim:
        out = torch.empty(query.shape, dtype=query.dtype)  # the kernel writes packed heads
    table = block_table.to(torch.int32).contiguous()
    # The storage behind the permuted view: [kv_heads, blocks, block, D], contiguous.
    k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    status = cpu_library.library().kvfleet_prefill_attention_bf16(
        query.data_ptr(),
        query.stride(0),
        out.data_ptr(),
        out.stride(0),
        k_store.data_ptr(),
        v_store.data_ptr(),
        table.data_ptr(),
        seq_len,
        q_len,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"CPU prefill attention kernel: {_ERRORS.get(status, status)}")
    if target is not None and target is not out:
        target.copy_(out)
        return target
    return out

"""The C paged decode-attention kernel for the CPU path (kernels/cpu/cpu_attention.c), built and
loaded by kernels/cpu/cpu_library.py (where gcc is missing or `KVFLEET_CPU_KERNELS=0`, callers keep
the torch reference)."""

from __future__ import annotations

import torch
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import cpu_library
from kvfleet.kernels.policy import KernelPolicy

_DTYPES = cpu_library.DTYPE_CODES
_MAX_HEAD_DIM, _LANES, _MAX_BLOCK_SIZE = 256, 16, 256
_ERRORS = {1: "unsupported shape or dtype", 2: "out of memory for per-thread scratch"}


def uses_bf16_dot() -> bool:
    """Whether the built kernel computes bf16 caches with AVX512-BF16 dot products (gcc saw
    AVX512-BF16 under -march=native) rather than by widening K/V blocks to float32."""
    return available() and bool(cpu_library.library().kvfleet_cpu_attention_bf16_dot())


def uses_amx() -> bool:
    """Whether bf16 caches with head_dim 64 and blocks of a multiple of 16 tokens run on AMX
    tiles here (where a policy's `allow_amx` lets them)."""
    return available() and bool(cpu_library.library().kvfleet_cpu_attention_amx())


def available() -> bool:
    """Whether the kernel can run here (compiles it on the first call)."""
    return cpu_library.available()


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these inputs fit the kernel: CPU tensors, head-major caches of one supported
    dtype, head_dim a multiple of 16 up to 256, whole GQA groups."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    return (
        query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and k_cache.dtype in _DTYPES
        and v_cache.dtype == k_cache.dtype
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k_cache.shape == v_cache.shape
        and reference._is_head_major(k_cache)
        and reference._is_head_major(v_cache)
        and head_dim % _LANES == 0
        and 0 < head_dim <= _MAX_HEAD_DIM
        and 0 < block_size <= _MAX_BLOCK_SIZE
        and num_heads % num_kv_heads == 0
    )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`reference.decode_attention` computed by the C kernel (its AMX path where `policy`
    allows it); inputs it cannot take (see `supports`) or a disabled/unbuildable kernel go to
    the reference instead."""
    if not (available() and supports(query, k_cache, v_cache)):
        return reference.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale
        )
    return run_decode(
        query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, policy=policy
    )


def run_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`decode_attention` for callers that have checked `available()` and `supports()` (the
    dispatch does, once per layer). Runs 30 times a step: a bf16 query goes in as it is, rows
    strided inside the qkv projection's output, and the output comes back in bf16, instead of
    through a float32 copy and a cast each way."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if query.dtype == torch.bfloat16 and query.stride(2) == 1 and query.stride(1) == head_dim:
        q, io_dtype = query, _DTYPES[torch.bfloat16]
    else:
        q, io_dtype = query.to(torch.float32).contiguous(), _DTYPES[torch.float32]
    out = torch.empty(query.shape, dtype=q.dtype)
    tables = block_tables
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    lens = seq_lens[:num_seqs]
    if lens.dtype != torch.int32 or not lens.is_contiguous():
        lens = lens.to(torch.int32).contiguous()
    # A head-major cache is a permuted view of [kv_heads, blocks, block, D] storage, which
    # starts at the view's own data pointer.
    status = cpu_library.library().kvfleet_decode_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), io_dtype,
        k_cache.data_ptr(), v_cache.data_ptr(), _DTYPES[k_cache.dtype],
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
        scale, torch.get_num_threads(), int(policy.allow_amx),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"CPU decode attention kernel: {_ERRORS.get(status, status)}")
    return out if out.dtype == query.dtype else out.to(query.dtype)

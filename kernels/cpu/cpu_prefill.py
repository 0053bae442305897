"""The CPU prefill-attention kernels: one sequence's prompt tokens (a chunk, or a suffix after a
prefix-cache hit) against its paged K/V. bf16 runs on AMX tiles (kernels/cpu/cpu_prefill.c, 1.7-2.6x
the speed of torch's SDPA flash kernel with head_dim 64, `kvfleet bench cpu-kernels`), or where
the CPU has no AMX on the float32-arithmetic kernel, which reads bf16 as it is (AVX512-BF16
products) or widened (kernels/cpu/cpu_prefill_f32.c); float32 on that kernel too. That kernel is
built for AVX-512, or AVX2 + FMA on CPUs without it. Where the CPU or build lacks what a
dtype's kernel needs (`available`), or the inputs do not fit (`supports`), callers keep the
reference's SDPA. Whether AMX may run, and the longest context an AVX2 build takes, are the
caller's `KernelPolicy`."""

from __future__ import annotations

import functools

import torch
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import cpu_library
from kvfleet.kernels.policy import KernelPolicy

_MAX_HEAD_DIM = 256
# The kernels bf16 prefill may run on (`bf16_kernel`).
KERNEL_AMX, KERNEL_AVX512, KERNEL_AVX2 = "AMX", "AVX-512", "AVX2"
_ERRORS = {
    1: "unsupported shape",
    2: "out of memory",
    3: "no AMX, AVX-512 or AVX2 on this CPU or build",
}


@functools.cache
def _vector_lanes(lib: object) -> int:
    # The float32-arithmetic kernel's width: 16 (AVX-512), 8 (AVX2 + FMA), 0 (neither).
    return int(lib.kvfleet_prefill_f32_lanes())


def _vectors() -> str | None:
    """Which instruction set the float32-arithmetic kernel was built for, None where none."""
    if not cpu_library.available():
        return None
    return {16: KERNEL_AVX512, 8: KERNEL_AVX2}.get(_vector_lanes(cpu_library.library()))


@functools.cache
def _amx(lib: object) -> bool:
    # Keyed by the loaded library: a reloaded one (tests clear library()'s cache) asks again.
    return bool(lib.kvfleet_prefill_attention_amx())


def bf16_kernel(policy: KernelPolicy) -> str | None:
    """Which kernel bf16 prefills run on here under `policy`: KERNEL_AMX where the CPU grants
    AMX tiles and the policy allows them, else the float32-arithmetic kernel's KERNEL_AVX512 or
    KERNEL_AVX2, else None (SDPA)."""
    if not cpu_library.available():
        return None
    if policy.allow_amx and _amx(cpu_library.library()):
        return KERNEL_AMX
    return _vectors()


def _on_amx(query: torch.Tensor, policy: KernelPolicy) -> bool:
    return query.dtype == torch.bfloat16 and bf16_kernel(policy) == KERNEL_AMX


def available(dtype: torch.dtype = torch.bfloat16, *, policy: KernelPolicy) -> bool:
    """Whether `dtype`'s kernel can run here under `policy`: the C library builds, and the CPU
    grants AMX tiles (bf16) or the build has AVX-512 or AVX2 + FMA (either dtype)."""
    if dtype == torch.float32:
        return _vectors() is not None
    return dtype == torch.bfloat16 and bf16_kernel(policy) is not None


def supports(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, policy: KernelPolicy
) -> bool:
    """CPU tensors of one dtype, bf16 or float32; head-major caches; whole GQA groups; each
    token's heads packed. bf16 on AMX: head_dim a multiple of 32 up to 256, blocks a multiple of
    16 tokens; on AVX-512 or AVX2 (float32, or bf16 without AMX): head_dim a multiple of 16 up
    to 256, any block size."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    bf16 = _on_amx(query, policy)
    return (
        query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype
        and query.dtype in (torch.bfloat16, torch.float32)
        and k_cache.shape == v_cache.shape
        and reference._is_head_major(k_cache)
        and reference._is_head_major(v_cache)
        and head_dim % (32 if bf16 else 16) == 0
        and 0 < head_dim <= _MAX_HEAD_DIM
        and (block_size % 16 == 0 or not bf16)
        and num_heads % num_kv_heads == 0
        and query.stride(2) == 1
        and query.stride(1) == head_dim
    )


def takes(
    query: torch.Tensor, seq_len: int, *, policy: KernelPolicy, q_len: int | None = None
) -> bool:
    """Whether the kernel takes `q_len` query tokens (default: the query's) of a sequence of
    `seq_len` context tokens: built for AVX2 it leaves queries longer than the policy's
    `avx2_prefill_short_query` whose contexts pass its `avx2_prefill_max_context` to SDPA,
    which is faster there (bf16 on AMX takes every one)."""
    q_len = query.shape[0] if q_len is None else q_len
    return (
        _on_amx(query, policy)
        or _vectors() != KERNEL_AVX2
        or seq_len <= policy.avx2_prefill_max_context
        or q_len <= policy.avx2_prefill_short_query
    )


def run_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
    *,
    policy: KernelPolicy,
) -> bool:
    """`reference.paged_attention`'s prefill_fn (with `policy` bound): this sequence into `out`
    on the kernel (True), or False where the kernel leaves it to the reference (`takes`)."""
    if not takes(query, seq_len, policy=policy):
        return False
    prefill_attention(query, k_cache, v_cache, block_table, seq_len, scale, out, policy=policy)
    return True


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`reference.prefill_attention` (causal, the query being the last q of `seq_len`
    positions) written into `out` ([q, heads, D], heads packed per token) when given, on the
    kernel `policy` picks. Callers check `available(query.dtype, policy=policy)` and
    `supports()` first."""
    q_len, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    target = out
    if out is None or out.stride(2) != 1 or out.stride(1) != head_dim:
        out = torch.empty(query.shape, dtype=query.dtype)  # the kernel writes packed heads
    table = block_table.to(torch.int32).contiguous()
    # The storage behind the permuted view: [kv_heads, blocks, block, D], contiguous.
    k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    lib = cpu_library.library()
    if query.dtype == torch.float32:
        kernel = lib.kvfleet_prefill_attention_f32
    elif bf16_kernel(policy) == KERNEL_AMX:
        kernel = lib.kvfleet_prefill_attention_bf16
    else:
        kernel = lib.kvfleet_prefill_attention_bf16_vec
    status = kernel(
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

"""The fused CPU elementwise kernels (kernels/cpu/cpu_elementwise.c) behind the same signatures as
their torch references: RMSNorm with residual add, neox rotary embedding (alone, or with the
new K/V written into the paged cache), SwiGLU's silu-and-mul.

They take bfloat16 or float32 activations (the CPU default with and without AVX512-BF16). In
float32 they differ from the reference by float32 summation order and exp's approximation, a
few ulp, as the C decode attention already did; float32 runs still give Hugging Face's greedy
tokens (tests/runtime/test_engine_matches_hf.py). Inputs a kernel cannot take go to the
reference; `supports_*` say which.
"""

from __future__ import annotations

import torch
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import cpu_cache, cpu_library

_LANES = 16
_MAX_ROTARY_DIM = 1024


_ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)


def _is_cpu_activation(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype the kernels take (bf16 or float32)."""
    dtype = tensors[0].dtype
    return dtype in _ACTIVATION_DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype for t in tensors
    )


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"CPU {name} kernel: unsupported shape (status {status})")


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    hidden = x.shape[-1]
    return (
        x.dim() == 2
        and _is_cpu_activation(x, weight)
        and x.stride(-1) == 1
        and hidden % _LANES == 0
        and weight.shape == (hidden,)
        and weight.is_contiguous()
        and (
            residual is None
            or (
                residual.dtype == torch.float32
                and residual.shape == x.shape
                and residual.is_contiguous()
                and residual.device.type == "cpu"
            )
        )
        and cpu_library.available()
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm` in one pass. Unlike the reference, a given `residual` is updated in
    place (it becomes x + residual and is returned), as vLLM's fused_add_rms_norm does: a new
    [tokens, hidden] float32 tensor per call costs page faults on every prefill step."""
    if not supports_rms_norm(x, weight, residual):
        return reference.rms_norm(x, weight, eps, residual)
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)  # contiguous, as the kernel writes it
    res = residual if residual is not None else torch.empty(rows, hidden, dtype=torch.float32)
    status = cpu_library.library().kvfleet_add_rms_norm(
        x.data_ptr(),
        x.stride(0),
        res.data_ptr(),
        int(residual is not None),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        cpu_library.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    _check(status, "rms_norm")
    return out, res


def _heads_packed(t: torch.Tensor) -> bool:
    """[tokens, heads, D] with D contiguous and heads adjacent (a view of a fused qkv row)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def supports_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> bool:
    rot = cos_sin_cache.shape[-1]
    return (
        is_neox
        and _is_cpu_activation(query, key)
        and _heads_packed(query)
        and _heads_packed(key)
        and query.shape[0] == key.shape[0] == positions.numel()
        and query.shape[2] == key.shape[2]
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.stride(1) == 1
        and 0 < rot <= min(query.shape[2], _MAX_ROTARY_DIM)
        and rot % 2 == 0
        and cpu_library.available()
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_embedding`, rotating q and k in place (neox layout; the GPT-J layout
    goes to the reference)."""
    if not supports_rotary(positions, query, key, cos_sin_cache, is_neox):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    status = cpu_library.library().kvfleet_rotary_neox(
        positions.data_ptr(),
        positions.numel(),
        query.data_ptr(),
        query.stride(0),
        query.shape[1],
        key.data_ptr(),
        key.stride(0),
        key.shape[1],
        query.shape[2],
        cos_sin_cache.shape[-1],
        cos_sin_cache.data_ptr(),
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        cpu_library.DTYPE_CODES[query.dtype],
        torch.get_num_threads(),
    )
    if status == 2:
        raise IndexError(f"rotary_embedding: a position is outside [0, {cos_sin_cache.shape[0]})")
    _check(status, "rotary")
    return query, key


def rotary_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
) -> torch.Tensor:
    """`rotary_embedding` then `cpu_cache.reshape_and_cache` of the rotated key and the value
    in one C call, the same bytes (one ctypes call and one check per layer instead of two, K
    written to the cache while in L1). Returns the rotated query; key is rotated in place."""
    if not (
        supports_rotary(positions, query, key, cos_sin_cache, is_neox)
        and k_cache.dtype == query.dtype
        and cpu_cache.supports(key, value, k_cache, v_cache, slot_mapping)
    ):
        query, key = rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        cpu_cache.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        return query
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    status = cpu_library.library().kvfleet_rotary_and_cache(
        positions.data_ptr(), positions.numel(),
        query.data_ptr(), query.stride(0), query.shape[1],
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key.shape[1],
        query.shape[2], cos_sin_cache.shape[-1],
        cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        num_blocks, block_size, cpu_library.DTYPE_CODES[query.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:
        raise IndexError(f"rotary_embedding: a position is outside [0, {cos_sin_cache.shape[0]})")
    if status == 3:
        raise IndexError(f"reshape_and_cache: a slot is past the cache ({num_blocks * block_size})")
    _check(status, "rotary-and-cache")
    return query


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and _is_cpu_activation(x)
        and x.stride(1) == 1
        and x.shape[1] % 2 == 0
        and x.shape[1] > 0
        and cpu_library.available()
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul` in one pass, rounding once (in bf16 the reference rounds silu's
    result before the multiply, so results differ by up to one bf16 step)."""
    if not supports_silu_and_mul(x):
        return reference.silu_and_mul(x)
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    status = cpu_library.library().kvfleet_silu_and_mul(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        rows,
        d,
        cpu_library.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    _check(status, "silu_and_mul")
    return out

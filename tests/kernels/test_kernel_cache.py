"""Triton reshape_and_cache against the reference: exactly the mapped slots change."""

import pytest
import torch
from kvfleet.kernels import reference
from kvfleet.kernels.triton import triton_cache


@pytest.mark.parametrize(
    "tokens,kv_heads,head_dim,block_size,dtype",
    [
        (1, 1, 64, 16, torch.float32),
        (13, 2, 80, 8, torch.bfloat16),
        (40, 3, 128, 32, torch.float32),
    ],
)
def test_cache_write_matches_reference(tokens, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(tokens)
    num_blocks = tokens // block_size + 4
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1  # a padding token the kernel must skip
    # K and V as views of a fused projection output: strided rows, contiguous head_dim.
    qkv = torch.randn((tokens, 3, kv_heads, head_dim), generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    got_k, got_v = (
        torch.full(shape, float("nan"), dtype=dtype),
        torch.full(shape, float("nan"), dtype=dtype),
    )
    want_k, want_v = got_k.clone(), got_v.clone()

    triton_cache.reshape_and_cache(key, value, got_k, got_v, slots)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)

    torch.testing.assert_close(got_k, want_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(got_v, want_v, equal_nan=True, rtol=0, atol=0)
    written = (~got_k.isnan()).flatten(2).all(-1).sum().item()
    assert written == tokens - 1

"""The C reshape_and_cache against the torch reference on head-major caches."""

import pytest
import torch
from kvfleet.kernels import cpu_cache, reference

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def caches(num_blocks, block_size, kv_heads, head_dim, dtype, head_major=True):
    k, v = reference.allocate_kv_cache(
        num_blocks, block_size, kv_heads, head_dim, dtype, "cpu", head_major=head_major
    )
    k.fill_(float("nan")), v.fill_(float("nan"))  # poisoned: an unwritten slot stays NaN
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,kv_heads,head_dim,block_size", [(1, 1, 64, 8), (37, 3, 64, 16), (9, 8, 128, 32)]
)
def test_writes_the_same_slots_as_the_reference(dtype, tokens, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(tokens)
    kv_size = kv_heads * head_dim
    q_size = 2 * kv_size  # K and V are views into a fused qkv row, as the model makes them
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    key = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(12 * block_size, generator=gen)[:tokens]
    slots[::4] = -1  # padding rows are skipped
    want_k, want_v = caches(12, block_size, kv_heads, head_dim, dtype)
    got_k, got_v = caches(12, block_size, kv_heads, head_dim, dtype)

    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    cpu_cache.reshape_and_cache(key, value, got_k, got_v, slots)

    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0, equal_nan=True)


def test_a_slot_past_the_cache_is_an_error_and_writes_nothing():
    k, v = caches(2, 8, 1, 64, torch.bfloat16)
    key = torch.randn(2, 1, 64).to(torch.bfloat16)
    with pytest.raises(IndexError, match=r"past the cache \(16\)"):
        cpu_cache.reshape_and_cache(key, key, k, v, torch.tensor([3, 16]))
    assert bool(k.isnan().all())


def test_a_contiguous_cache_goes_to_the_reference():
    """The Triton layout ([blocks, block, heads, D] contiguous) is not the C kernel's."""
    k, v = caches(4, 8, 2, 64, torch.float32, head_major=False)
    assert not cpu_cache.supports(torch.randn(3, 2, 64), torch.randn(3, 2, 64), k, v,
                                  torch.tensor([0, 1, 2]))  # fmt: skip
    key = torch.randn(3, 2, 64)
    cpu_cache.reshape_and_cache(key, key, k, v, torch.tensor([0, 9, 31]))
    assert torch.equal(k[1, 1], key[1]) and torch.equal(v[3, 7], key[2])

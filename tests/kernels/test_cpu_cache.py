"""The C reshape_and_cache against the torch reference on head-major caches."""

import pytest
import torch
from kvfleet.kernels import dispatch, reference
from kvfleet.kernels.cpu import cpu_cache, cpu_elementwise

# The default kernel policy's dispatch, as a model built with none runs it.
KERNELS = dispatch.Kernels()

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


def _qkv_step(tokens, heads, kv_heads, head_dim, seed, dtype=torch.bfloat16):
    """q, k, v as the model makes them: views into one fused qkv row per token."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    return qkv, q, k, v, gen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,block_size",
    [(1, 9, 3, 64, 16), (70, 8, 2, 128, 8), (300, 9, 3, 64, 32)],
)
def test_rotary_and_cache_writes_the_bytes_of_the_two_separate_calls(
    dtype, tokens, heads, kv_heads, head_dim, block_size
):
    """One C call per layer instead of rotary then reshape_and_cache: the same rotated q and
    k, the same cache bytes, padding slots skipped (300 tokens run on the OpenMP team)."""
    qkv, q, k, v, gen = _qkv_step(tokens, heads, kv_heads, head_dim, tokens, dtype)
    cos_sin = torch.randn(2048, head_dim, generator=gen)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    slots = torch.randperm(40 * block_size, generator=gen)[:tokens]
    slots[1::5] = -1
    want_qkv = qkv.clone()
    wq, wk, wv = (t.view(tokens, -1, head_dim) for t in want_qkv.split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1))  # fmt: skip
    want_k, want_v = caches(40, block_size, kv_heads, head_dim, dtype)
    got_k, got_v = caches(40, block_size, kv_heads, head_dim, dtype)
    wq, wk = cpu_elementwise.rotary_embedding(positions, wq, wk, cos_sin)
    cpu_cache.reshape_and_cache(wk, wv, want_k, want_v, slots)

    got_q = KERNELS.rotary_and_cache(positions, q, k, v, cos_sin, got_k, got_v, slots)

    assert got_q.data_ptr() == q.data_ptr() and torch.equal(qkv, want_qkv)
    assert torch.equal(got_q, wq)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0, equal_nan=True)
    assert int((~got_k.isnan()).all(-1).sum()) == kv_heads * int((slots >= 0).sum())


def test_rotary_and_cache_bad_slot_or_position_is_an_error_that_writes_nothing():
    qkv, q, k, v, gen = _qkv_step(3, 2, 1, 64, 0)
    before = qkv.clone()
    k_cache, v_cache = caches(2, 8, 1, 64, torch.bfloat16)
    cos_sin = torch.randn(16, 64, generator=gen)
    with pytest.raises(IndexError, match=r"past the cache \(16\)"):
        KERNELS.rotary_and_cache(torch.tensor([0, 1, 2]), q, k, v, cos_sin, k_cache, v_cache,
                                  torch.tensor([3, 16, 4]))  # fmt: skip
    with pytest.raises(IndexError, match=r"outside \[0, 16\)"):
        KERNELS.rotary_and_cache(torch.tensor([0, 16, 2]), q, k, v, cos_sin, k_cache, v_cache,
                                  torch.tensor([3, 15, 4]))  # fmt: skip
    assert torch.equal(qkv, before) and bool(k_cache.isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_and_cache_into_an_fp8_cache_takes_the_separate_paths(dtype):
    """An fp8 cache (rows converted first) is not the fused kernel's: the result is still the
    separate calls'."""
    cache_dtype = torch.float8_e4m3fn
    _, q, k, v, gen = _qkv_step(5, 3, 1, 64, 3, dtype)
    cos_sin = torch.randn(32, 64, generator=gen)
    positions, slots = torch.arange(5), torch.tensor([0, 9, -1, 4, 30])
    want_k, want_v = reference.allocate_kv_cache(4, 8, 1, 64, cache_dtype, "cpu", head_major=True)
    got_k, got_v = reference.allocate_kv_cache(4, 8, 1, 64, cache_dtype, "cpu", head_major=True)
    wq, wk = cpu_elementwise.rotary_embedding(positions, q.clone(), k.clone(), cos_sin)
    cpu_cache.reshape_and_cache(wk, v, want_k, want_v, slots)
    got_q = KERNELS.rotary_and_cache(positions, q, k, v, cos_sin, got_k, got_v, slots)
    assert torch.equal(got_q, wq)
    assert torch.equal(got_k.float(), want_k.float()) and torch.equal(got_v.float(), want_v.float())


def test_head_major_check_matches_the_storage_layout():
    """The C kernels' layout check: true for head-major caches (and for a one-head token-major
    cache, the same bytes), false for token-major caches and for slices of a head-major cache
    whose head planes are no longer contiguous."""
    head_major = caches(6, 16, 3, 64, torch.bfloat16)[0]
    token_major = caches(6, 16, 3, 64, torch.bfloat16, head_major=False)[0]
    one_head = caches(6, 16, 1, 64, torch.bfloat16, head_major=False)[0]
    assert reference._is_head_major(head_major) and reference._is_head_major(one_head)
    assert not reference._is_head_major(token_major)
    assert not reference._is_head_major(head_major[:3])  # planes 6 blocks apart, 3 long
    assert not reference._is_head_major(head_major[:, :8])

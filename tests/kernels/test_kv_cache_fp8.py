"""fp8 KV caches (--kv-cache-dtype fp8 / fp8_e5m2): writes saturate instead of overflowing to
NaN, and every attention path (the torch reference, the C decode kernel, the Triton decode and
prefill kernels) reads the same fp8 cache to the same result: attention over its values."""

import math

import pytest
import torch
from kernel_cases import (
    TOLERANCE,
    attention_metadata,
    contiguous_context,
    dense_attention,
    paged_case,
)
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import cpu_attention, cpu_cache
from kvfleet.kernels.policy import DEFAULT_POLICY
from kvfleet.kernels.triton import triton_decode, triton_prefill

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", FP8)
def test_writes_saturate_to_the_formats_largest_value(dtype):
    limit = reference.FP8_MAX[dtype]
    key = torch.tensor([[[3.0, -5120.0, 1e6, 0.5]]], dtype=BF16)  # [1 token, 1 head, D=4]
    for write in (reference.reshape_and_cache, cpu_cache.reshape_and_cache):
        k, v = reference.allocate_kv_cache(2, 4, 1, 4, dtype, "cpu", head_major=True)
        write(key, key, k, v, torch.tensor([5]))
        row = k[1, 1, 0].float()
        assert not row.isnan().any()
        want = [3.0, -5120.0 if dtype == torch.float8_e5m2 else -limit, limit, 0.5]
        assert row.tolist() == [max(-limit, min(limit, w)) for w in want]
        assert torch.equal(v[1, 1, 0].float(), row)


@pytest.mark.parametrize("dtype", FP8)
def test_c_and_reference_decode_read_fp8_caches_alike(dtype):
    gen = torch.Generator().manual_seed(3)
    lens = [1, 16, 17, 45, 80]
    case = paged_case(gen, lens, 16, 2, 64, dtype)
    # The engine's layout: head-major storage, which the C kernel reads.
    k, v = reference.allocate_kv_cache(
        *case.k_cache.shape[:2], 2, 64, dtype, "cpu", head_major=True
    )
    k.copy_(case.k_cache)
    v.copy_(case.v_cache)
    query = torch.randn((len(lens), 6, 64), generator=gen).to(BF16)
    args = (case.block_tables, case.seq_lens, max(lens), 0.125)
    got = cpu_attention.decode_attention(query, k, v, *args, policy=DEFAULT_POLICY)
    want = reference.decode_attention(query, k, v, *args)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[BF16])
    for i, n in enumerate(lens):  # and both are attention over the stored values
        dense = dense_attention(
            query[i : i + 1].float(),
            contiguous_context(k, case.block_tables[i], n).float(),
            contiguous_context(v, case.block_tables[i], n).float(),
            0.125,
        )
        torch.testing.assert_close(got[i : i + 1].double(), dense, **TOLERANCE[BF16])


@pytest.mark.parametrize("dtype", FP8)
def test_c_decode_widens_every_fp8_value_exactly(dtype):
    # Small keys put many values on the formats' subnormals (the C kernel's widening takes a
    # separate path for them); with float32 queries any widening error would show.
    gen = torch.Generator().manual_seed(5)
    k, v = reference.allocate_kv_cache(40, 16, 3, 64, dtype, "cpu", head_major=True)
    k.copy_((torch.randn(k.shape, generator=gen) * 0.02).to(dtype))
    v.copy_((torch.randn(v.shape, generator=gen) * 0.02).to(dtype))
    assert ((k.float().abs() > 0) & (k.float().abs() < 2**-6)).any()  # subnormals present
    tables = torch.randperm(40, generator=gen)[:28].to(torch.int32).view(4, 7)
    lens = torch.tensor([100, 50, 17, 1], dtype=torch.int32)
    query = torch.randn((4, 9, 64), generator=gen) * 30
    got = cpu_attention.decode_attention(
        query, k, v, tables, lens, 100, 0.125, policy=DEFAULT_POLICY
    )
    want = reference.decode_attention(query, k, v, tables, lens, 100, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", FP8)
def test_triton_kernels_read_fp8_caches_like_the_reference(dtype):
    gen = torch.Generator().manual_seed(11)
    lens, q_lens = [23, 9, 40], [1, 9, 12]  # a decode, a fresh prefill, a chunk after cached
    case = paged_case(gen, lens, 8, 2, 64, dtype)
    meta = attention_metadata(case, q_lens, 1, 8)
    query = torch.randn((sum(q_lens), 4, 64), generator=gen).to(BF16)
    scale = 1 / math.sqrt(64)
    want = reference.paged_attention(query, case.k_cache, case.v_cache, meta, scale)
    decode = triton_decode.decode_attention(
        query[:1], case.k_cache, case.v_cache, case.block_tables[:1], case.seq_lens[:1], 23, scale
    )
    torch.testing.assert_close(decode.float(), want[:1].float(), **TOLERANCE[BF16])
    prefill = triton_prefill.prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        meta.query_start_loc, max(q_lens), scale, first_seq=1,
    )  # fmt: skip
    torch.testing.assert_close(prefill[1:].float(), want[1:].float(), **TOLERANCE[BF16])


@pytest.mark.parametrize("dtype", FP8)
def test_triton_cache_write_saturates_like_the_reference(dtype):
    from kvfleet.kernels.triton import triton_cache

    key = torch.tensor([[[3.0, -5120.0, 1e6, 0.5]], [[1.0, 2.0, 3.0, 4.0]]], dtype=BF16)
    slots = torch.tensor([5, -1])
    got_k, got_v = reference.allocate_kv_cache(2, 4, 1, 4, dtype, "cpu")
    want_k, want_v = reference.allocate_kv_cache(2, 4, 1, 4, dtype, "cpu")
    triton_cache.reshape_and_cache(key, key, got_k, got_v, slots)
    reference.reshape_and_cache(key, key, want_k, want_v, slots)
    assert torch.equal(got_k.float(), want_k.float()) and torch.equal(got_v.float(), want_v.float())

"""Triton varlen prefill and the mixed-batch path against the torch reference."""

import pytest
import torch
from kernel_cases import TOLERANCE, attention_metadata, paged_case, ragged_lengths
from kvfleet.kernels import reference
from kvfleet.kernels.triton import triton_prefill

BF16, F32 = torch.bfloat16, torch.float32

# (batch, kv_heads, gqa ratio, head_dim, block_size, dtype, block_m, block_n, max_len)
CASES = [
    (1, 1, 1, 64, 16, F32, 16, 16, 1),
    (3, 1, 3, 64, 8, F32, 16, 16, 40),
    (4, 1, 8, 128, 16, BF16, 16, 32, 49),
    (2, 2, 1, 128, 32, BF16, 64, 64, 70),
    (6, 1, 3, 96, 32, F32, 16, 16, 33),
    (5, 1, 8, 80, 8, BF16, 32, 16, 25),
]


@pytest.mark.parametrize(
    "batch,kv_heads,ratio,head_dim,block_size,dtype,block_m,block_n,max_len",
    CASES,
    ids=[f"b{c[0]}-kvh{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}-{str(c[5])[6:]}" for c in CASES],
)
def test_prefill_matches_reference(
    poison_allocations,
    batch,
    kv_heads,
    ratio,
    head_dim,
    block_size,
    dtype,
    block_m,
    block_n,
    max_len,
):
    gen = torch.Generator().manual_seed(hash((batch, kv_heads, ratio, head_dim, 1)) % 2**31)
    lens = ragged_lengths(gen, batch, block_size, max_len)
    # Some sequences are whole prompts, others chunks whose start is already cached.
    q_lens = [n if i % 2 == 0 else int(torch.randint(1, n + 1, (1,), generator=gen))
              for i, n in enumerate(lens)]  # fmt: skip
    case = paged_case(gen, lens, block_size, kv_heads, head_dim, dtype)
    meta = attention_metadata(case, q_lens, 0, block_size)
    heads = kv_heads * ratio
    query = torch.randn((sum(q_lens), heads, head_dim), generator=gen).to(dtype)
    scale = head_dim**-0.5

    got = triton_prefill.prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        meta.query_start_loc, max(q_lens), scale, block_m=block_m, block_n=block_n,
    )  # fmt: skip
    want = reference.paged_attention(query, case.k_cache, case.v_cache, meta, scale)
    assert not got.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mixed_batch_through_dispatch(poison_allocations, triton_kernels, dtype):
    # Decodes first (one token each), then a fresh prompt, a chunk after a cached prefix,
    # and a one-token chunk: one forward step of a continuous-batching engine.
    gen = torch.Generator().manual_seed(11)
    block_size, kv_heads, heads, head_dim = 16, 2, 6, 64
    lens = [17, 1, 32, 33, 20, 48, 5]
    q_lens = [1, 1, 1, 1, 20, 15, 1]
    case = paged_case(gen, lens, block_size, kv_heads, head_dim, dtype)
    meta = attention_metadata(case, q_lens, 4, block_size)
    query = torch.randn((sum(q_lens), heads, head_dim), generator=gen).to(dtype)

    got = triton_kernels.paged_attention(query, case.k_cache, case.v_cache, meta, 0.125)
    want = reference.paged_attention(query, case.k_cache, case.v_cache, meta, 0.125)
    assert not got.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])

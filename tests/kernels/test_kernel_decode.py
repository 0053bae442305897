"""Triton paged decode attention against the torch reference over a sampled shape grid."""

import pytest
import torch
from kernel_cases import TOLERANCE, paged_case, ragged_lengths
from kvfleet.kernels import reference
from kvfleet.kernels.triton import triton_decode

BF16, F32 = torch.bfloat16, torch.float32

# (batch, num_kv_heads, gqa ratio, head_dim, block_size, dtype, num_splits, block_n, max_len):
# a hand-sampled grid covering every value of each axis at least once, not the full product.
# num_splits None = the heuristic; block_n 16 makes short contexts span several tiles.
CASES = [
    (1, 1, 1, 64, 16, F32, None, 16, 1),
    (3, 2, 3, 64, 8, F32, None, 16, 40),
    (5, 1, 8, 128, 16, BF16, None, 64, 70),
    (8, 2, 1, 128, 32, BF16, 3, 16, 90),
    (17, 1, 3, 64, 32, F32, 2, 16, 66),
    (4, 1, 8, 80, 8, BF16, 4, 16, 50),
    (6, 2, 3, 96, 16, F32, None, 32, 33),
    (2, 1, 8, 128, 8, F32, 5, 16, 81),
    (11, 1, 1, 64, 16, BF16, 2, 32, 65),
]


@pytest.mark.parametrize(
    "batch,kv_heads,ratio,head_dim,block_size,dtype,splits,block_n,max_len",
    CASES,
    ids=[f"b{c[0]}-kvh{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}-{str(c[5])[6:]}-s{c[6]}" for c in CASES],
)
def test_decode_matches_reference(
    poison_allocations,
    batch,
    kv_heads,
    ratio,
    head_dim,
    block_size,
    dtype,
    splits,
    block_n,
    max_len,
):
    gen = torch.Generator().manual_seed(hash((batch, kv_heads, ratio, head_dim)) % 2**31)
    lens = ragged_lengths(gen, batch, block_size, max_len)
    case = paged_case(gen, lens, block_size, kv_heads, head_dim, dtype)
    heads = kv_heads * ratio
    query = torch.randn((batch, heads, head_dim), generator=gen).to(dtype)
    scale = head_dim**-0.5

    got = triton_decode.decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, max(lens), scale,
        num_splits=splits, block_n=block_n,
    )  # fmt: skip
    want = reference.decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, max(lens), scale
    )
    assert not got.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_decode_writes_only_its_rows_of_a_shared_output(poison_allocations):
    # The mixed-batch path hands the decode kernel a slice of the batch's output.
    gen = torch.Generator().manual_seed(7)
    case = paged_case(gen, [9, 1, 24], 8, 1, 64, F32)
    query = torch.randn((5, 2, 64), generator=gen)
    out = torch.full_like(query, 123.0)
    triton_decode.decode_attention(
        query[:3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 24, 0.125,
        out=out[:3], num_splits=2, block_n=16,
    )  # fmt: skip
    want = reference.decode_attention(
        query[:3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 24, 0.125
    )
    torch.testing.assert_close(out[:3], want, **TOLERANCE[F32])
    assert (out[3:] == 123.0).all()


@pytest.mark.parametrize(
    "seqs,kv_heads,max_len,expected",
    [
        (1, 8, 8192, 32),  # tiny batch, long context: split to fill 132 SMs
        (8, 8, 2048, 5),  # 64 programs: ceil(264 / 64) = 5 splits
        (64, 8, 2048, 1),  # 512 programs already fill the GPU
        (1, 8, 200, 1),  # too short to be worth a reduce pass
        (1, 1, 100_000, 64),  # capped
    ],
)
def test_split_heuristic(seqs, kv_heads, max_len, expected):
    assert triton_decode.choose_num_splits(seqs, kv_heads, max_len, num_sms=132) == expected


def test_decode_rejects_mismatched_heads():
    k = torch.zeros(4, 8, 3, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads 3"):
        triton_decode.decode_attention(
            torch.zeros(1, 4, 64), k, k, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, 1.0,
        )  # fmt: skip

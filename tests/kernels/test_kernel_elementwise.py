"""Fused RMSNorm, SiLU-and-mul and rotary embedding kernels against the reference."""

import pytest
import torch
from kvfleet.kernels import reference
from kvfleet.kernels.triton import triton_rms_norm, triton_rotary, triton_silu_and_mul

BF16, F32 = torch.bfloat16, torch.float32
# Elementwise ops round once to the storage dtype; bf16 has 8 bits of mantissa.
TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize(
    "rows,hidden,dtype,with_residual",
    [(1, 64, F32, False), (7, 576, BF16, True), (5, 96, F32, True), (3, 1000, BF16, False)],
)
def test_rms_norm(poison_allocations, rows, hidden, dtype, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn((rows, hidden), generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    # The model passes the float32 residual stream back in from the previous layer.
    residual = torch.randn((rows, hidden), generator=gen) if with_residual else None
    x_before = x.clone()

    out, summed = triton_rms_norm.rms_norm(x, weight, 1e-6, residual)
    want_out, want_sum = reference.rms_norm(x, weight, 1e-6, residual)

    torch.testing.assert_close(out, want_out, **TOL[dtype])
    # float32 sums are exact; Triton's interpreter truncates float32 → bfloat16 where torch
    # rounds to nearest, so bf16 sums may differ by one unit in the last place.
    torch.testing.assert_close(
        summed, want_sum, **(TOL[dtype] if dtype == BF16 else dict(rtol=0, atol=0))
    )
    assert torch.equal(x, x_before), "input must not be modified"


@pytest.mark.parametrize(
    "shape,dtype", [((1, 2 * 64), F32), ((9, 2 * 1536), BF16), ((2, 3, 2 * 40), F32)]
)
def test_silu_and_mul(poison_allocations, shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = triton_silu_and_mul.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, reference.silu_and_mul(x), **TOL[dtype])


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,rotary_dim,is_neox,dtype",
    [
        (5, 4, 2, 64, 64, True, F32),
        (6, 3, 1, 128, 128, False, BF16),
        (4, 2, 2, 80, 80, True, BF16),
        (3, 2, 1, 64, 32, False, F32),  # partial rotary: the last 32 dims pass through
    ],
)
def test_rotary(poison_allocations, tokens, heads, kv_heads, head_dim, rotary_dim, is_neox, dtype):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    # q and k as views of one fused qkv projection, as the model produces them.
    qkv = torch.randn((tokens, heads + 2 * kv_heads, head_dim), generator=gen).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    cache = _cos_sin_cache(128, rotary_dim)
    before = qkv.clone()

    got_q, got_k = triton_rotary.rotary_embedding(positions, q, k, cache, is_neox)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cache, is_neox)

    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv, before), "inputs must not be modified"

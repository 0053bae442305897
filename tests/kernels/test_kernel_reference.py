"""The torch reference — the specification and the CPU path — against naive dense formulas."""

import math

import pytest
import torch
from kernel_cases import attention_metadata, contiguous_context, dense_attention, paged_case
from kvfleet.kernels import reference


@pytest.mark.parametrize(
    "lens,q_lens,num_decodes,kv_heads,ratio,block_size",
    [
        ([1, 8, 9, 23], [1, 1, 1, 1], 4, 2, 1, 8),  # decode only
        ([16, 17, 5], [16, 4, 5], 0, 1, 3, 16),  # prefill only, one chunk after a cached prefix
        ([33, 1, 40, 32], [1, 1, 7, 32], 2, 1, 8, 16),  # mixed
    ],
)
def test_paged_attention_equals_dense_softmax(
    lens, q_lens, num_decodes, kv_heads, ratio, block_size
):
    gen = torch.Generator().manual_seed(sum(lens))
    head_dim, heads = 64, kv_heads * ratio
    case = paged_case(gen, lens, block_size, kv_heads, head_dim, torch.float32)
    meta = attention_metadata(case, q_lens, num_decodes, block_size)
    query = torch.randn((sum(q_lens), heads, head_dim), generator=gen)
    scale = 1 / math.sqrt(head_dim)

    got = reference.paged_attention(query, case.k_cache, case.v_cache, meta, scale)

    start = 0
    for i, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
        k = contiguous_context(case.k_cache, case.block_tables[i], n)
        v = contiguous_context(case.v_cache, case.block_tables[i], n)
        want = dense_attention(query[start : start + q], k, v, scale)
        torch.testing.assert_close(got[start : start + q].double(), want, atol=1e-5, rtol=1e-5)
        start += q


def test_one_steps_context_masks_serve_every_layer():
    # Sequence 0 decodes, 1 is a prefill with no cached context (plain causal, no mask), 2 and 3
    # are chunks after cached tokens: their masks are built by the first layer, then reused.
    gen = torch.Generator().manual_seed(7)
    lens, q_lens = [12, 9, 30, 21], [1, 9, 6, 20]
    case = paged_case(gen, lens, 8, 2, 64, torch.float32)
    meta = attention_metadata(case, q_lens, 1, 8)
    for layer in range(2):  # each layer has its own cache contents, the step's metadata is shared
        k_cache = torch.randn(case.k_cache.shape, generator=gen)
        v_cache = torch.randn(case.v_cache.shape, generator=gen)
        query = torch.randn((sum(q_lens), 4, 64), generator=gen)
        got = reference.paged_attention(query, k_cache, v_cache, meta, 0.125)
        if layer == 0:
            first_masks = dict(meta.prefill_masks)
        start = 0
        for i, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
            k = contiguous_context(k_cache, case.block_tables[i], n)
            v = contiguous_context(v_cache, case.block_tables[i], n)
            want = dense_attention(query[start : start + q], k, v, 0.125)
            torch.testing.assert_close(got[start : start + q].double(), want, atol=1e-5, rtol=1e-5)
            start += q
    assert sorted(meta.prefill_masks) == [2, 3]
    assert all(meta.prefill_masks[i] is first_masks[i] for i in (2, 3))
    assert meta.prefill_masks[3].shape == (20, 21)


def test_reshape_and_cache_places_token_at_block_and_offset():
    k_cache = torch.zeros(4, 8, 2, 4)
    v_cache = torch.zeros(4, 8, 2, 4)
    key = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4) + 1
    reference.reshape_and_cache(key, -key, k_cache, v_cache, torch.tensor([3 * 8 + 5, -1]))
    assert torch.equal(k_cache[3, 5], key[0]) and torch.equal(v_cache[3, 5], -key[0])
    assert k_cache.count_nonzero() == key[0].numel(), "the -1 slot must be skipped"


def test_rms_norm_formula():
    x = torch.tensor([[3.0, 4.0]])
    out, summed = reference.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0, torch.tensor([[0.0, 0.0]]))
    rms = math.sqrt((9 + 16) / 2)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 8 / rms]]))
    assert torch.equal(summed, x)


def test_silu_and_mul_formula():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    silu = torch.tensor([1.0, -2.0]) / (1 + torch.exp(-torch.tensor([1.0, -2.0])))
    torch.testing.assert_close(reference.silu_and_mul(x), (silu * torch.tensor([3.0, 0.5]))[None])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_is_a_complex_rotation(is_neox):
    # Each rotated pair (x1, x2) at position p becomes (x1 + i x2) * e^{i p θ_j}.
    gen = torch.Generator().manual_seed(5)
    head_dim, pos = 8, 3
    theta = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(6, dtype=torch.float64)[:, None] * theta
    cache = torch.cat((angles.cos(), angles.sin()), -1).float()
    q = torch.randn((1, 1, head_dim), generator=gen)
    got, _ = reference.rotary_embedding(torch.tensor([pos]), q, q.clone(), cache, is_neox)
    half = head_dim // 2
    pairs = (q[0, 0, :half], q[0, 0, half:]) if is_neox else (q[0, 0, 0::2], q[0, 0, 1::2])
    rotated = torch.complex(pairs[0].double(), pairs[1].double()) * torch.exp(1j * pos * theta)
    if is_neox:
        want = torch.cat((rotated.real, rotated.imag))
    else:
        want = torch.stack((rotated.real, rotated.imag), -1).flatten()
    torch.testing.assert_close(got[0, 0].double(), want, atol=1e-6, rtol=1e-6)

"""The CPU prefill-attention kernels (bf16 on AMX; float32, and bf16 without AMX, on AVX-512)
against a dense float64 softmax and the SDPA reference, and the dispatch that picks them where
the CPU has what they need."""

from dataclasses import replace

import pytest
import torch
from kernel_cases import (
    TOLERANCE,
    attention_metadata,
    contiguous_context,
    cpu_flags,
    cpu_has_amx,
    dense_attention,
    head_major,
    paged_case,
    record_rows,
)
from kvfleet.kernels import dispatch, reference
from kvfleet.kernels.cpu import cpu_library, cpu_prefill
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy

BF16, F32 = torch.bfloat16, torch.float32
# float32 against a float64 softmax: summation order and exp's 2 ulp, nothing more.
CLOSE = {BF16: TOLERANCE[BF16], F32: dict(atol=1e-5, rtol=1e-5)}

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


# The kernels a test can run: bf16 on AMX, bf16 on AVX-512 (its policy switches AMX off, so an
# AMX host tests both), float32 on AVX-512.
AMX, AVX512_BF16, AVX512_F32 = "amx", "avx512-bf16", "avx512-f32"
KERNEL_DTYPE = {AMX: BF16, AVX512_BF16: BF16, AVX512_F32: F32}


def _use(kernel: str) -> tuple[torch.dtype, KernelPolicy]:
    """`kernel`'s dtype and the kernel policy that routes that dtype to it, or skip where this
    CPU lacks it."""
    policy = KernelPolicy(allow_amx=kernel == AMX)
    want = {AMX: cpu_prefill.KERNEL_AMX, AVX512_BF16: cpu_prefill.KERNEL_AVX512}.get(kernel)
    if kernel == AVX512_F32:
        if not cpu_prefill.available(F32, policy=policy):
            pytest.skip("this CPU or build has no AVX-512 (a test below checks which)")
    elif cpu_prefill.bf16_kernel(policy) != want:
        pytest.skip(f"this CPU or build has no {want} (a test below checks which)")
    return KERNEL_DTYPE[kernel], policy


def test_kernels_where_the_cpu_has_them():
    """bf16 runs on AMX wherever the CPU has AMX-BF16, else on the float32-arithmetic kernel
    built for AVX-512 or AVX2 + FMA; float32 on the latter wherever the CPU has either: a
    build or permission failure there is a bug, so the numeric tests below cannot skip silently
    on such a machine."""
    flags = cpu_flags()
    vectors = (
        cpu_prefill.KERNEL_AVX512
        if "avx512f" in flags
        else cpu_prefill.KERNEL_AVX2
        if {"avx2", "fma"} <= flags
        else None
    )
    want = cpu_prefill.KERNEL_AMX if cpu_has_amx() else vectors
    assert cpu_prefill.bf16_kernel(DEFAULT_POLICY) == want
    assert cpu_prefill.available(policy=DEFAULT_POLICY) == (want is not None)
    assert cpu_prefill.available(F32, policy=DEFAULT_POLICY) == (vectors is not None)


def test_the_avx2_build_matches_dense_softmax(monkeypatch):
    """Built as for an AVX2 + FMA CPU (KVFLEET_CPU_MAX_ISA=avx2): 8-lane vectors, smaller
    register blocks, the AVX2 exp; float32 and widened bf16, against a float64 softmax."""
    if "avx512f" not in cpu_flags() or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs a CPU with AVX-512 to build the AVX2 form beside the regular one")
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx2")
    policy = KernelPolicy(allow_amx=False)
    cpu_library.library.cache_clear()
    assert cpu_prefill.bf16_kernel(policy) == cpu_prefill.KERNEL_AVX2
    for dtype in (F32, BF16):
        for q_len, seq_len, kv_heads, ratio, head_dim, block_size, *ramp in (
            CASES + F32_CASES[:2] + SPLIT_CASES
        ):
            query, k, v, table = _case(
                q_len + 3, q_len, seq_len, kv_heads, ratio, head_dim, block_size, *ramp, dtype=dtype
            )
            scale = head_dim**-0.5
            got = cpu_prefill.prefill_attention(query, k, v, table, seq_len, scale, policy=policy)
            dense = _dense(query, k, v, table, seq_len, scale)
            torch.testing.assert_close(got.double(), dense, **CLOSE[dtype])
    # Past the policy's avx2_prefill_max_context the AVX2 build leaves a query longer than its
    # avx2_prefill_short_query to SDPA, which is faster there: run_prefill (the dispatch's
    # prefill_fn) declines it, writing nothing, and takes a shorter context or query.
    short = KernelPolicy(allow_amx=False, avx2_prefill_max_context=50, avx2_prefill_short_query=8)
    query, k, v, table = _case(1, 20, 60, 2, 3, 64, 16)
    out = torch.full_like(query, 7.0)
    assert not cpu_prefill.run_prefill(query, k, v, table, 60, 0.125, out, policy=short)
    assert bool((out == 7.0).all())
    for q_len, seq_len in ((20, 50), (8, 60)):
        query, k, v, table = _case(1, q_len, seq_len, 2, 3, 64, 16)
        out = torch.full_like(query, 7.0)
        assert cpu_prefill.run_prefill(query, k, v, table, seq_len, 0.125, out, policy=short)
        dense = _dense(query, k, v, table, seq_len, 0.125)
        torch.testing.assert_close(out.double(), dense, **CLOSE[BF16])


def _case(seed, q_len, seq_len, kv_heads, ratio, head_dim, block_size, ramp=0.0, dtype=BF16):
    """One sequence's query and paged cache; `ramp` scales key p by 1 + ramp * p."""
    gen = torch.Generator().manual_seed(seed)
    case = paged_case(gen, [seq_len], block_size, kv_heads, head_dim, dtype)
    for p in range(seq_len):
        block, offset = int(case.block_tables[0, p // block_size]), p % block_size
        case.k_cache[block, offset] *= 1 + ramp * p
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    query = torch.randn((q_len, kv_heads * ratio, head_dim), generator=gen).to(dtype)
    return query, k, v, case.block_tables[0]


def _dense(query, k, v, table, seq_len, scale):
    """The float64 softmax over the sequence's first `seq_len` cached positions."""
    kc, vc = contiguous_context(k, table, seq_len), contiguous_context(v, table, seq_len)
    return dense_attention(query, kc, vc, scale)


# (q_len, seq_len, kv_heads, gqa ratio, head_dim, block_size): one query; one whole 16-query
# tile; a tail tile after cached context; a full causal prompt with GQA 8 and 32-token blocks;
# a short suffix after a long cached prefix (a prefix-cache hit); head_dim 128 and 96 (O through
# memory rather than tile registers); head_dim 32 with 48-token blocks. float32 adds 8-token
# blocks, head_dim 16, and a 2048-token prompt (tiles of 32 rows, steps of 32 keys, two threads).
CASES = [
    (1, 1, 1, 1, 64, 16),
    (16, 16, 3, 3, 64, 16),
    (17, 40, 3, 3, 64, 16),
    (100, 100, 1, 8, 64, 32),
    (7, 300, 2, 1, 64, 16),
    (45, 77, 2, 2, 128, 32),
    (50, 90, 2, 4, 96, 16),
    (33, 33, 1, 3, 32, 48),
]
F32_CASES = [(30, 45, 2, 3, 64, 8), (9, 9, 1, 4, 16, 16), (2048, 2048, 3, 3, 64, 16)]
KERNEL_CASES = (
    [(AMX, *c) for c in CASES]
    + [(AVX512_BF16, *c) for c in CASES]
    + [(AVX512_F32, *c) for c in CASES + F32_CASES]
)


@pytest.mark.parametrize(
    "kernel,q_len,seq_len,kv_heads,ratio,head_dim,block_size",
    KERNEL_CASES,
    ids=[f"{c[0]}-q{c[1]}-ctx{c[2]}-kvh{c[3]}-g{c[4]}-d{c[5]}-bs{c[6]}" for c in KERNEL_CASES],
)
def test_prefill_matches_dense_softmax_and_sdpa(
    kernel, q_len, seq_len, kv_heads, ratio, head_dim, block_size
):
    dtype, policy = _use(kernel)
    query, k, v, table = _case(q_len * seq_len, q_len, seq_len, kv_heads, ratio, head_dim,
                               block_size, dtype=dtype)  # fmt: skip
    scale = head_dim**-0.5
    got = cpu_prefill.prefill_attention(query, k, v, table, seq_len, scale, policy=policy)
    assert got.dtype == dtype
    dense = _dense(query, k, v, table, seq_len, scale)
    torch.testing.assert_close(got.double(), dense, **CLOSE[dtype])
    sdpa = reference.prefill_attention(query, k, v, table, seq_len, scale)
    torch.testing.assert_close(got, sdpa, **TOLERANCE[dtype])


def test_bf16_on_avx512_without_bf16_dot_products(monkeypatch):
    """Built for an AVX-512 CPU without AVX512-BF16 (Skylake-SP, say), bf16 inputs widen to
    float32 and take the float32 products instead of vdpbf16ps: the same function."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("the regular build here already is one without AVX512-BF16")
    monkeypatch.setattr(cpu_library, "FLAGS", [*cpu_library.FLAGS, "-mno-avx512bf16"])
    cpu_library.library.cache_clear()
    _, policy = _use(AVX512_BF16)
    for q_len, seq_len, kv_heads, ratio, head_dim, block_size in CASES[:5]:
        query, k, v, table = _case(q_len, q_len, seq_len, kv_heads, ratio, head_dim, block_size)
        scale = head_dim**-0.5
        got = cpu_prefill.prefill_attention(query, k, v, table, seq_len, scale, policy=policy)
        dense = _dense(query, k, v, table, seq_len, scale)
        torch.testing.assert_close(got.double(), dense, **CLOSE[BF16])


# Short queries deep into long contexts (a prompt chunk late in a long prompt, a suffix after a
# prefix-cache hit), where the float32-arithmetic kernel has under 8 tasks a thread and splits
# each tile's keys into ranges: 4 tokens of GQA 3 (one 12-row tile per kv head), 20 tokens (two
# tiles per head), 6 tokens of GQA 8 (a 32-row tile and a one-vector one), one token with
# head_dim 128 and 32-token blocks; the last with keys that keep rising (key p scaled by
# 1 + p / 250), so that the ranges' maxima lie nats apart and the merge must rescale them.
SPLIT_CASES = [
    (4, 1500, 3, 3, 64, 16, 0.0),
    (20, 900, 2, 3, 64, 16, 0.0),
    (6, 1200, 1, 8, 64, 16, 0.0),
    (1, 3000, 2, 4, 128, 32, 0.0),
    (5, 2000, 1, 3, 64, 16, 0.004),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", [AVX512_BF16, AVX512_F32])
def test_short_queries_against_long_contexts_split_the_keys(kernel, threads):
    """The split ranges' results merge into the softmax over all keys, on one thread (8 tasks
    wanted) and two (16), so in ranges of different lengths."""
    dtype, policy = _use(kernel)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_len, seq_len, kv_heads, ratio, head_dim, block_size, ramp in SPLIT_CASES:
            query, k, v, table = _case(
                seq_len, q_len, seq_len, kv_heads, ratio, head_dim, block_size, ramp, dtype
            )
            scale = head_dim**-0.5
            got = cpu_prefill.prefill_attention(query, k, v, table, seq_len, scale, policy=policy)
            assert torch.isfinite(got.float()).all()
            dense = _dense(query, k, v, table, seq_len, scale)
            torch.testing.assert_close(got.double(), dense, **TOLERANCE[dtype])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", [AMX, AVX512_BF16, AVX512_F32])
def test_scores_that_keep_rising_rescale_exactly(kernel):
    """Keys growing along the sequence (key p scaled by 1 + p / 20) make the scores' range grow
    to hundreds of nats, so the running max passes its slack again and again: every rescale
    must keep the result a softmax (no overflow, no stale-max bias)."""
    dtype, policy = _use(kernel)
    query, k, v, table = _case(7, 64, 700, 1, 3, 64, 16, ramp=0.05, dtype=dtype)
    scale = 64**-0.5
    got = cpu_prefill.prefill_attention(query, k, v, table, 700, scale, policy=policy)
    assert torch.isfinite(got.float()).all()
    dense = _dense(query, k, v, table, 700, scale)
    # Scores of hundreds of nats carry float32's rounding into every probability (SDPA's float32
    # error here is the kernel's, 3.5e-5): the looser float32 bound.
    torch.testing.assert_close(got.double(), dense, **TOLERANCE[dtype])


@pytest.mark.parametrize("kernel", [AMX, AVX512_BF16, AVX512_F32])
def test_reads_queries_from_a_fused_qkv_row_and_writes_into_a_slice(kernel):
    """The model's query is a view of the fused qkv projection (token stride > heads * D) and
    the result goes into rows of the step's output tensor."""
    dtype, policy = _use(kernel)
    q_len, heads, kv_heads, d = 20, 6, 2, 64
    query, k, v, table = _case(3, q_len, 50, kv_heads, heads // kv_heads, d, 16, dtype=dtype)
    qkv = torch.zeros(q_len, (heads + 2 * kv_heads) * d, dtype=dtype)
    qkv[:, : heads * d] = query.reshape(q_len, -1)
    strided = qkv[:, : heads * d].view(q_len, heads, d)
    out = torch.full((q_len + 5, heads, d), 7.0, dtype=dtype)
    cpu_prefill.prefill_attention(strided, k, v, table, 50, 0.125, out=out[5:], policy=policy)
    assert torch.equal(out[:5], torch.full((5, heads, d), 7.0, dtype=dtype))  # untouched
    want = reference.prefill_attention(query, k, v, table, 50, 0.125)
    torch.testing.assert_close(out[5:], want, **TOLERANCE[dtype])
    # A destination whose heads are not packed per token is written through a packed buffer.
    heads_major = torch.zeros(heads, q_len, d, dtype=dtype).transpose(0, 1)
    got = cpu_prefill.prefill_attention(
        strided, k, v, table, 50, 0.125, out=heads_major, policy=policy
    )
    assert got is heads_major
    torch.testing.assert_close(heads_major, want, **TOLERANCE[dtype])


def _mixed_batch(dtype=BF16, block_size=16, activations=BF16):
    """Two decodes then two prefills (one over cached context) in one step."""
    gen = torch.Generator().manual_seed(11)
    lens, query_lens = [30, 18, 40, 25], [1, 1, 40, 9]
    case = paged_case(gen, lens, block_size, 2, 64, activations)
    meta = attention_metadata(case, query_lens, num_decodes=2, block_size=block_size)
    k, v = head_major(case.k_cache).to(dtype), head_major(case.v_cache).to(dtype)
    tokens = torch.randn((sum(query_lens), 6, 64), generator=gen).to(activations)
    return tokens, k, v, meta


DISPATCH_CASES = [(AMX, 16), (AVX512_BF16, 16), (AVX512_BF16, 8), (AVX512_F32, 16), (AVX512_F32, 8)]


@pytest.mark.parametrize("kernel,block_size", DISPATCH_CASES)
def test_dispatch_runs_prefills_on_the_kernel(monkeypatch, kernel, block_size):
    dtype, policy = _use(kernel)
    calls = record_rows(monkeypatch, cpu_prefill, "prefill_attention")
    tokens, k, v, meta = _mixed_batch(dtype, block_size, activations=dtype)
    got = dispatch.Kernels(policy).paged_attention(tokens, k, v, meta, 0.125)
    assert calls == [40, 9]  # one call per prefill, none for the decodes
    want = reference.paged_attention(tokens, k, v, meta, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_the_avx2_build_leaves_long_contexts_of_a_step_to_sdpa(monkeypatch):
    """Built for AVX2, a prefill whose context passes the policy's avx2_prefill_max_context and
    whose query passes its avx2_prefill_short_query runs on the reference's SDPA, in the same
    step as shorter ones on the kernel."""
    if not cpu_prefill.available(F32, policy=DEFAULT_POLICY):
        pytest.skip("this CPU or build has no AVX-512 or AVX2 (a test above checks which)")
    tokens, k, v, meta = _mixed_batch(F32, activations=F32)
    want = reference.paged_attention(tokens, k, v, meta, 0.125)
    # An AVX2 build, as the CPU reports it (whatever this one is).
    monkeypatch.setattr(cpu_prefill, "_vectors", lambda: cpu_prefill.KERNEL_AVX2)
    # The prefills: 40 tokens of 40 in context, 9 of 25.
    policy = KernelPolicy(avx2_prefill_max_context=30, avx2_prefill_short_query=8)
    kernel_rows = record_rows(monkeypatch, cpu_prefill, "prefill_attention")
    sdpa_rows = record_rows(monkeypatch, reference, "prefill_attention")
    got = dispatch.Kernels(policy).paged_attention(tokens, k, v, meta, 0.125)
    assert kernel_rows == [9] and sdpa_rows == [40]
    torch.testing.assert_close(got, want, **TOLERANCE[F32])
    # A 40-token query is short enough under the default policy's 64.
    kernel_rows.clear()
    sdpa_rows.clear()
    policy = replace(DEFAULT_POLICY, avx2_prefill_max_context=30)
    got = dispatch.Kernels(policy).paged_attention(tokens, k, v, meta, 0.125)
    assert kernel_rows == [40, 9] and sdpa_rows == []
    torch.testing.assert_close(got, want, **TOLERANCE[F32])


@pytest.mark.parametrize("reason", ["fp8 cache", "bf16 8-token blocks on AMX", "kernels off"])
def test_what_the_kernel_does_not_take_stays_on_sdpa(monkeypatch, reason):
    calls = record_rows(monkeypatch, cpu_prefill, "prefill_attention")
    policy = DEFAULT_POLICY
    if reason == "fp8 cache":
        tokens, k, v, meta = _mixed_batch(dtype=torch.float8_e4m3fn)
    elif reason == "bf16 8-token blocks on AMX":
        _, policy = _use(AMX)
        tokens, k, v, meta = _mixed_batch(block_size=8)
    else:
        monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
        tokens, k, v, meta = _mixed_batch()
    got = dispatch.Kernels(policy).paged_attention(tokens, k, v, meta, 0.125)
    assert calls == []
    want = reference.paged_attention(tokens, k, v, meta, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[BF16])

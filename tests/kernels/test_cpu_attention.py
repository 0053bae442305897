"""The C CPU decode-attention kernel against the torch reference and a dense float64 softmax,
plus its fallbacks: disabled by KVFLEET_CPU_KERNELS=0, or unbuildable (broken compiler)."""

import logging

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
    ragged_lengths,
)
from kvfleet.kernels import dispatch, reference
from kvfleet.kernels.cpu import cpu_attention, cpu_library
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy

BF16, F32 = torch.bfloat16, torch.float32

# (batch, num_kv_heads, gqa ratio, head_dim, block_size, dtype, max_len): every value of each
# axis at least once — batch 1..17, GQA 1/3/8, head_dim 64/128, block 8/16/32, float32/bfloat16.
CASES = [
    (1, 1, 1, 64, 16, F32, 1),
    (3, 2, 3, 64, 8, F32, 40),
    (5, 1, 8, 128, 16, BF16, 70),
    (8, 2, 1, 128, 32, BF16, 90),
    (17, 1, 3, 64, 32, F32, 66),
    (6, 3, 3, 64, 16, BF16, 200),
    (2, 1, 8, 128, 8, F32, 81),
    (11, 1, 1, 64, 16, BF16, 65),
    # A block size no vector width divides: the exp and max vectors run past the block.
    (4, 3, 3, 64, 12, F32, 100),
]

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def make_inputs(seed, batch, kv_heads, ratio, head_dim, block_size, dtype, max_len):
    gen = torch.Generator().manual_seed(seed)
    lens = ragged_lengths(gen, batch, block_size, max_len)
    case = paged_case(gen, lens, block_size, kv_heads, head_dim, dtype)
    query = torch.randn((batch, kv_heads * ratio, head_dim), generator=gen).to(dtype)
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    return case, lens, (query, k, v, case.block_tables, case.seq_lens, max(lens), head_dim**-0.5)


def test_kernel_builds_here():
    """gcc is on every machine these tests run on: a build failure is a bug, not a skip."""
    assert cpu_attention.available()


def test_bf16_dot_path_built_where_the_cpu_has_it():
    """On a CPU with AVX512-BF16 the bf16 cases above run the dot-product path, not the
    widening one: -march=native must have enabled it."""
    assert cpu_attention.uses_bf16_dot() == ("avx512_bf16" in cpu_flags())


def test_amx_path_where_the_cpu_has_it():
    """bf16 caches with head_dim 64 run on AMX tiles wherever the CPU has AMX-BF16, so the
    `amx` cases below test that path there (and the dot path where their policy turns it
    off)."""
    assert cpu_attention.uses_amx() == cpu_has_amx()


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@pytest.mark.parametrize(
    "batch,kv_heads,ratio,head_dim,block_size,dtype,max_len",
    CASES,
    ids=[f"b{c[0]}-kvh{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}-{str(c[5])[6:]}" for c in CASES],
)
def test_decode_matches_reference_and_dense(
    poison_allocations, either_build, amx, batch, kv_heads, ratio, head_dim,
    block_size, dtype, max_len,
):  # fmt: skip
    policy = KernelPolicy(allow_amx=amx)
    case, lens, args = make_inputs(
        hash((batch, kv_heads, ratio)) % 2**31, batch, kv_heads, ratio, head_dim, block_size,
        dtype, max_len,
    )  # fmt: skip
    query, k, v = args[:3]
    assert cpu_attention.supports(query, k, v)
    got = cpu_attention.decode_attention(*args, policy=policy)
    assert got.dtype == dtype and got.shape == query.shape
    assert not got.isnan().any(), "unwritten output elements"
    want = reference.decode_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    # The kernel accumulates in float32 from exact bf16 → f32 widening, so against a float64
    # softmax of the same (rounded) inputs it is tighter than the reference's bf16 matmuls.
    for s, n in enumerate(lens):
        kc = contiguous_context(case.k_cache, case.block_tables[s], n)
        vc = contiguous_context(case.v_cache, case.block_tables[s], n)
        dense = dense_attention(query[s : s + 1], kc, vc, args[-1])[0]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got[s].double(), dense, **tol)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_decode_scores_that_keep_rising_rescale_exactly(either_build, dtype):
    """Keys growing along the context (key p scaled by 1 + p / 20) push each head's running max
    past its slack again and again; the AMX path's rescales, and the float32 path's (which
    skips the rescale when a block leaves the max alone), must keep an exact softmax."""
    gen = torch.Generator().manual_seed(5)
    lens = [600, 333, 100]
    case = paged_case(gen, lens, 16, 1, 64, dtype)
    for s, n in enumerate(lens):
        for p in range(n):
            case.k_cache[int(case.block_tables[s, p // 16]), p % 16] *= 1 + 0.05 * p
    query = torch.randn((len(lens), 3, 64), generator=gen).to(dtype)
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    got = cpu_attention.decode_attention(
        query, k, v, case.block_tables, case.seq_lens, max(lens), 0.125, policy=DEFAULT_POLICY
    )
    assert torch.isfinite(got).all()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)
    for s, n in enumerate(lens):
        kc = contiguous_context(case.k_cache, case.block_tables[s], n)
        vc = contiguous_context(case.v_cache, case.block_tables[s], n)
        dense = dense_attention(query[s : s + 1], kc, vc, 0.125)[0]
        torch.testing.assert_close(got[s].double(), dense, **tol)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_bf16_query_strided_in_qkv_rows_gives_the_float32_paths_bits(amx):
    """A bf16 model's q is a view into the qkv projection's rows; the kernel reads it in place
    and writes bf16, the same bits as widening q to float32 and casting the output back."""
    policy = KernelPolicy(allow_amx=amx)
    _, _, (query, k, v, tables, lens, max_len, scale) = make_inputs(3, 9, 3, 3, 64, 16, BF16, 150)
    qkv = torch.randn((9, query.shape[1] * 64 + 2 * 3 * 64), dtype=F32).to(BF16)
    q_view = qkv[:, : query.shape[1] * 64].view(9, query.shape[1], 64)
    q_view.copy_(query)
    assert not q_view.is_contiguous()
    got = cpu_attention.run_decode(q_view, k, v, tables, lens, max_len, scale, policy=policy)
    via_float32 = cpu_attention.run_decode(
        q_view.float(), k, v, tables, lens, max_len, scale, policy=policy
    )
    assert got.dtype == BF16 and via_float32.dtype == F32
    assert torch.equal(got, via_float32.to(BF16))


def test_thread_counts_agree():
    """Each (sequence, kv head) is computed by one thread in a fixed order: 1 and 2 threads
    give bit-identical results."""
    _, _, args = make_inputs(7, 13, 3, 3, 64, 16, BF16, 300)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode_attention(*args, policy=DEFAULT_POLICY)
        torch.set_num_threads(2)
        two = cpu_attention.decode_attention(*args, policy=DEFAULT_POLICY)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_unsupported_inputs_go_to_reference():
    """A token-major cache, float16 or head_dim 72 (not a multiple of 16) are the reference's: same answer, no error."""
    _, _, (query, k, v, *rest) = make_inputs(3, 4, 2, 3, 64, 16, F32, 50)
    assert not cpu_attention.supports(query, k.contiguous(), v.contiguous())
    got = cpu_attention.decode_attention(
        query, k.contiguous(), v.contiguous(), *rest, policy=DEFAULT_POLICY
    )
    torch.testing.assert_close(got, reference.decode_attention(query, k, v, *rest))
    half = (query.half(), k.half(), v.half())
    assert not cpu_attention.supports(*half)
    assert (
        cpu_attention.decode_attention(*half, *rest, policy=DEFAULT_POLICY).dtype == torch.float16
    )
    _, _, (q72, k72, v72, *rest72) = make_inputs(4, 3, 1, 2, 72, 8, F32, 30)
    assert not cpu_attention.supports(q72, k72, v72)
    torch.testing.assert_close(
        cpu_attention.decode_attention(q72, k72, v72, *rest72, policy=DEFAULT_POLICY),
        reference.decode_attention(q72, k72, v72, *rest72),
    )


def _dispatch_mixed_batch(monkeypatch, expect_kernel: bool) -> None:
    """Two decodes and a 5-token prefill through dispatch.paged_attention: correct either way,
    and the C kernel called exactly when expected."""
    case, _, (query, k, v, *_) = make_inputs(11, 3, 1, 3, 64, 16, F32, 40)
    meta = attention_metadata(case, [1, 1, 5], num_decodes=2, block_size=16)
    tokens = torch.randn((7, query.shape[1], 64), generator=torch.Generator().manual_seed(1))
    calls = []
    real = cpu_attention.run_decode
    monkeypatch.setattr(
        cpu_attention, "run_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = dispatch.Kernels().paged_attention(tokens, k, v, meta, 0.125)
    want = reference.paged_attention(tokens, k, v, meta, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[F32])
    assert bool(calls) == expect_kernel


def test_dispatch_uses_kernel_for_decodes(monkeypatch):
    _dispatch_mixed_batch(monkeypatch, expect_kernel=True)


def test_env_disables_kernel(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    assert not cpu_attention.available()
    _dispatch_mixed_batch(monkeypatch, expect_kernel=False)


def test_broken_compiler_falls_back_with_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_library, "COMPILER", ["false"])
    cpu_library.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
        assert not cpu_attention.available()
        assert not cpu_attention.available()  # the failure is remembered, not retried
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch reference" in warnings[0].getMessage()
    _dispatch_mixed_batch(monkeypatch, expect_kernel=False)
    assert not list(tmp_path.rglob("*.so"))


def test_library_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    """A second build of the same source reuses the file; different flags (or an ISA cap) get
    a file of their own. Only the first is compiled: a build's file is `library_path`'s."""
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    first = cpu_library.build()
    assert first.parent == tmp_path / "kernels" and first == cpu_library.build()
    assert first == cpu_library.library_path(cpu_library.build_flags())
    assert cpu_library.library_path([*cpu_library.FLAGS, "-DKVFLEET_TEST=1"]) != first
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx2")
    assert cpu_library.library_path(cpu_library.build_flags()) != first
    assert not list(tmp_path.rglob("*.tmp"))


# Contexts past SPLIT_KEYS (1024) keys are cut into ranges computed as separate tasks and
# combined after; the lengths straddle each cut.
LONG_LENS = [1025, 2048, 2600, 1024, 5, 3073]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@pytest.mark.parametrize(
    "dtype,block_size", [(F32, 16), (BF16, 16), (BF16, 32), (F32, 8), (torch.float8_e4m3fn, 16)]
)
def test_long_contexts_split_then_combined_match_dense(either_build, amx, dtype, block_size):
    policy = KernelPolicy(allow_amx=amx)
    gen = torch.Generator().manual_seed(11)
    case = paged_case(gen, LONG_LENS, block_size, 2, 64, BF16 if dtype.itemsize == 1 else dtype)
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    if dtype.itemsize == 1:  # fp8 caches: the kernel widens what the rounding kept
        k, v = k.to(dtype), v.to(dtype)
    query = torch.randn((len(LONG_LENS), 6, 64), generator=gen).to(BF16 if dtype != F32 else F32)
    assert cpu_attention.supports(query, k, v)
    got = cpu_attention.decode_attention(
        query, k, v, case.block_tables, case.seq_lens, max(LONG_LENS), 0.125, policy=policy
    )
    for s, n in enumerate(LONG_LENS):
        kc = contiguous_context(k.float(), case.block_tables[s], n)
        vc = contiguous_context(v.float(), case.block_tables[s], n)
        dense = dense_attention(query[s : s + 1].float(), kc, vc, 0.125)[0]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got[s].double(), dense, **tol)


def test_a_long_sequence_gets_the_same_bits_alone_in_a_batch_and_on_one_thread():
    """Where a context is cut depends on its own length only: a sequence's output does not
    depend on the batch beside it or on the thread count (the tokens a seed gives must not)."""
    gen = torch.Generator().manual_seed(12)
    case = paged_case(gen, LONG_LENS, 16, 3, 64, BF16)
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    query = torch.randn((len(LONG_LENS), 9, 64), generator=gen).to(BF16)
    batch = cpu_attention.run_decode(
        query, k, v, case.block_tables, case.seq_lens, max(LONG_LENS), 0.125,
        policy=DEFAULT_POLICY,
    )  # fmt: skip
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for s in (0, 2, 5):
                alone = cpu_attention.run_decode(
                    query[s : s + 1], k, v, case.block_tables[s : s + 1],
                    case.seq_lens[s : s + 1], LONG_LENS[s], 0.125, policy=DEFAULT_POLICY,
                )  # fmt: skip
                assert torch.equal(alone[0], batch[s]), (threads, s)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, BF16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8"])
def test_verify_rows_of_one_sequence_get_the_bits_each_row_gets_alone(either_build, dtype, threads):
    """A speculative verify step gives a sequence one row per token it checks, over the same
    block table, the rows one key longer each. The kernel reads their blocks once for all of them
    (float32 path); each row must still get exactly what it gets alone, or speculation would
    change greedy tokens. Around them: a sequence sharing the first block but not the rest (a
    prefix-cache hit, consecutive lengths: it must not be read through the others' table), rows
    of a context long enough to be split, and a row alone."""
    gen = torch.Generator().manual_seed(21)
    bs, short, long = 16, 203, 1100
    cache_dtype = BF16 if dtype.itemsize == 1 else dtype
    case = paged_case(gen, [short + 4, short + 5, long + 2, 40], bs, 3, 64, cache_dtype)
    k, v = head_major(case.k_cache), head_major(case.v_cache)
    if dtype.itemsize == 1:
        k, v = k.to(dtype), v.to(dtype)
    t = case.block_tables
    twin = t[1].clone()
    twin[0] = t[0, 0]  # shares the first block only
    rows = [(t[0], short + i) for i in range(5)] + [(twin, short + 5)]
    rows += [(t[2], long + i) for i in range(3)] + [(t[3], 40)]
    tables = torch.stack([table for table, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    query = torch.randn((len(rows), 9, 64), generator=gen).to(F32 if dtype == F32 else BF16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = cpu_attention.run_decode(
            query, k, v, tables, lens, int(lens.max()), 0.125, policy=DEFAULT_POLICY
        )
        for i, (table, n) in enumerate(rows):
            alone = cpu_attention.run_decode(
                query[i : i + 1], k, v, table[None], lens[i : i + 1], n, 0.125,
                policy=DEFAULT_POLICY,
            )  # fmt: skip
            assert torch.equal(alone[0], together[i]), i
    finally:
        torch.set_num_threads(previous)
    for i, (table, n) in enumerate(rows):
        kc = contiguous_context(k.float(), table, n)
        vc = contiguous_context(v.float(), table, n)
        dense = dense_attention(query[i : i + 1].float(), kc, vc, 0.125)[0]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(together[i].double(), dense, **tol)

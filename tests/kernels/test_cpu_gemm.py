"""The bf16 projection kernel for decode-sized row counts (kernels/cpu/cpu_gemm.c), on each of its
engines this CPU runs (AMX, AVX512-BF16; each picked by a kernel policy), against a float64
matmul, and the dispatch that sends a step's GEMMs to it or to oneDNN by row count."""

import pytest
import torch
import torch.nn.functional as F
from bf16_engines import bf16_engine
from kernel_cases import cpu_flags, cpu_has_amx
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_elementwise, cpu_gemm, cpu_linear
from kvfleet.kernels.policy import DEFAULT_POLICY

BF16 = torch.bfloat16
# The most rows the default policy sends to the AMX engine (the vector engine's is no more).
AMX_MAX_ROWS = DEFAULT_POLICY.amx_gemm_max_rows

# A test taking the `bf16_gemm_engine` fixture runs once per engine, under the policy that picks
# it (the fixture skips one this CPU lacks, with the reason).
pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def _assert_one_rounding(got, x, w, bias=None):
    """Every element is the bf16 rounding of the exact x · wᵀ + bias (float64: exact for bf16
    products) or its neighbour, give or take float32 accumulation's error (2^-18 of the sum of
    the terms' magnitudes, which summation in any order stays inside: a result near zero after
    cancellation may land a rounding step away), and nearly all are the rounding itself: a
    misplaced pair, column or row would be off by far more."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    want = exact.to(BF16)
    ulp = (want.double().abs() * 2.0**-7).clamp_min(2.0**-126)
    assert ((got.double() - exact).abs() <= ulp + magnitude * 2.0**-18).all()
    assert (got == want).float().mean() > 0.97


def test_each_engine_runs_where_the_cpu_has_it():
    """Each engine runs wherever the CPU has its instructions (AMX-BF16; AVX512-BF16), so the
    cases below cannot skip silently on such a machine."""
    assert cpu_gemm.amx_available() == cpu_has_amx()
    assert cpu_gemm.vectors_available() == ("avx512_bf16" in cpu_flags())


def test_the_forced_engine_is_the_one_that_runs(bf16_gemm_engine):
    policy = bf16_gemm_engine.policy
    want = {"AMX": cpu_gemm.KERNEL_AMX, "AVX512-BF16": cpu_gemm.KERNEL_AVX512_BF16}
    assert cpu_gemm.kernel(policy) == want[bf16_gemm_engine.name]
    assert cpu_gemm.max_rows(policy) == (
        policy.amx_gemm_max_rows
        if bf16_gemm_engine.name == "AMX"
        else policy.avx512_bf16_gemm_max_rows
    )


# Rows: a lone decode, a ragged tile, exactly one and two A tiles, a ragged second panel, a
# ragged third, one row past a row chunk (160 rows of A tiles at K 1536, 448 at K 576), and the
# largest count dispatch sends to AMX (several chunks, the last ragged); for the vector engine
# every pass size (1, 2, 3-4, 5-6 rows) and several passes with each kind of remainder. Shapes:
# the bundled model's qkv, o, down; one pair of column tiles with the shortest K.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 16, 17, 32, 33, 47, 65, 161, 449, AMX_MAX_ROWS])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (576, 1536), (32, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_the_rounded_exact_product(
    poison_allocations, bf16_gemm_engine, rows, n, k, with_bias
):
    gen = torch.Generator().manual_seed(rows * 7919 + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    got = cpu_gemm.linear(x, cpu_gemm.pack(w), bias, policy=bf16_gemm_engine.policy)
    assert got.dtype == BF16 and got.shape == (rows, n)
    _assert_one_rounding(got, x, w, bias)


def test_linear_reads_strided_rows_and_writes_nothing_else(bf16_gemm_engine):
    """A view into a wider buffer (the q slice of a fused qkv output) is read at its stride."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 96, generator=gen).to(BF16)
    x = wide[:, 32:]
    w = torch.randn(64, 64, generator=gen).to(BF16)
    got = cpu_gemm.linear(x, cpu_gemm.pack(w), policy=bf16_gemm_engine.policy)
    _assert_one_rounding(got, x, w)


def test_linear_rejects_a_mismatched_input(bf16_gemm_engine):
    policy = bf16_gemm_engine.policy
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=BF16))
    with pytest.raises(
        ValueError, match=r"input \(4, 32\) torch.bfloat16 does not fit a bf16 weight of \[32, 64\]"
    ):
        cpu_gemm.linear(torch.zeros(4, 32, dtype=BF16), packed, policy=policy)
    with pytest.raises(ValueError, match=r"input \(4, 64\) torch.float32 does not fit"):
        cpu_gemm.linear(torch.zeros(4, 64), packed, policy=policy)


def test_linear_of_no_rows_is_empty(bf16_gemm_engine):
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=BF16))
    got = cpu_gemm.linear(torch.zeros(0, 64, dtype=BF16), packed, policy=bf16_gemm_engine.policy)
    assert got.shape == (0, 32)


def test_pack_places_each_pair_where_the_tile_reads_it():
    """Tile (nb, kt), row r, lane 2c + p holds W[16·nb + c, 32·kt + 2r + p]."""
    w = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).to(BF16)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (4, 3, 16, 32)
    for nb, kt, r, c, p in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 1), (3, 1, 15, 15, 0), (2, 2, 7, 9, 1)]:
        assert packed[nb, kt, r, 2 * c + p] == w[16 * nb + c, 32 * kt + 2 * r + p]


# Row counts relative to the engine's limit (cpu_gemm.max_rows(policy) of the engine's policy):
# one row, the limit, one past it, and a prefill chunk past either limit.
@pytest.mark.parametrize("rows", [1, "limit", "limit + 1", 2000])
def test_dispatch_sends_decode_rows_to_the_kernel_and_the_rest_to_onednn(
    monkeypatch, bf16_gemm_engine, rows
):
    """Up to max_rows(policy) rows run cpu_gemm; more run oneDNN. Both round the exact product
    once (oneDNN's blocking, and so its summation order, changes with the row count: past the
    limit its packed weight and F.linear's plain one need not agree to the bit)."""
    policy = bf16_gemm_engine.policy
    limit = cpu_gemm.max_rows(policy)
    rows = {"limit": limit, "limit + 1": limit + 1}.get(rows, rows)
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    x = torch.randn(2, rows, 576, generator=gen).to(BF16)[0]
    packed = dispatch.prepack_linear_weight(w)
    assert isinstance(packed, cpu_linear.PackedLinear) and packed.tiles is not None
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a, **k: calls.append(a) or real(*a, **k))
    got = dispatch.Kernels(policy).linear(x, packed)
    assert len(calls) == (1 if rows <= limit else 0)
    _assert_one_rounding(got, x, w)


@pytest.mark.skipif(not cpu_linear._packs_bf16(), reason="bf16 weights are not packed here")
def test_shapes_the_kernel_does_not_take_stay_on_onednn():
    """Output features must pair up into 32-column units; others keep only oneDNN's layout."""
    w = torch.randn(48, 64).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    assert isinstance(packed, cpu_linear.PackedLinear) and packed.tiles is None
    x = torch.randn(3, 64).to(BF16)
    assert torch.equal(dispatch.Kernels().linear(x, packed), F.linear(x, w))


def test_dispatch_gives_strided_and_batched_inputs_their_shape(bf16_gemm_engine):
    """A [batch, tokens, in] input, or one whose columns are strided, comes back shaped like
    x with out_features last."""
    kernels = dispatch.Kernels(bf16_gemm_engine.policy)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 64, generator=gen) * 0.05).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    batched = torch.randn(2, 3, 64, generator=gen).to(BF16)
    got = kernels.linear(batched, packed)
    assert got.shape == (2, 3, 64)
    _assert_one_rounding(got.reshape(6, 64), batched.reshape(6, 64), w)
    strided = torch.randn(5, 128, generator=gen).to(BF16)[:, ::2]
    _assert_one_rounding(kernels.linear(strided, packed), strided, w)


@pytest.mark.parametrize("rows", [1, 5, 17, 33, AMX_MAX_ROWS])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rms_norm_linear_gives_the_two_calls_bits(bf16_gemm_engine, rows, with_residual, with_bias):
    """Normalising rows while packing them is the RMSNorm kernel then the GEMM, to the bit:
    the same output and the same updated residual."""
    gen = torch.Generator().manual_seed(rows + 2 * with_residual + with_bias)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    norm_w = (1 + 0.1 * torch.randn(576, generator=gen)).to(BF16)
    residual = torch.randn(rows, 576, generator=gen) if with_residual else None
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(960, generator=gen).to(BF16) if with_bias else None
    packed = cpu_gemm.pack(w)
    res_a = residual.clone() if with_residual else None
    res_b = residual.clone() if with_residual else None
    policy = bf16_gemm_engine.policy
    got, got_res = cpu_gemm.rms_norm_linear(x, norm_w, 1e-5, res_a, packed, bias, policy=policy)
    normed, want_res = cpu_elementwise.rms_norm(x, norm_w, 1e-5, res_b)
    assert torch.equal(got, cpu_gemm.linear(normed, packed, bias, policy=policy))
    assert torch.equal(got_res, want_res)
    if with_residual:
        assert got_res is res_a  # updated in place, as cpu_elementwise.rms_norm does


@pytest.mark.parametrize("past_limit", [False, True])
def test_dispatch_fuses_the_norm_only_where_the_kernel_runs(
    monkeypatch, bf16_gemm_engine, past_limit
):
    kernels = dispatch.Kernels(bf16_gemm_engine.policy)
    rows = cpu_gemm.max_rows(kernels.policy) + past_limit
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    norm_w = torch.ones(576).to(BF16)
    residual = torch.randn(rows, 576, generator=gen)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    fused = []
    real = cpu_gemm.rms_norm_linear
    monkeypatch.setattr(
        cpu_gemm, "rms_norm_linear", lambda *a, **k: fused.append(a) or real(*a, **k)
    )
    got, got_res = kernels.rms_norm_linear(x, norm_w, 1e-5, residual.clone(), packed)
    normed, want_res = kernels.rms_norm(x, norm_w, 1e-5, residual.clone())
    assert torch.equal(got, kernels.linear(normed, packed)) and torch.equal(got_res, want_res)
    assert len(fused) == (0 if past_limit else 1)


@pytest.mark.parametrize("rows", [1, 5, 17, 33, AMX_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_and_mul_linear_gives_the_two_calls_bits(bf16_gemm_engine, rows, with_bias):
    """Gating rows on their way into the GEMM is the silu-and-mul kernel then the GEMM, to the
    bit."""
    gen = torch.Generator().manual_seed(100 + rows + with_bias)
    gate_up = (torch.randn(2, rows, 2 * 1536, generator=gen) * 3).to(BF16)[1]  # any row stride
    w = (torch.randn(576, 1536, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(576, generator=gen).to(BF16) if with_bias else None
    packed = cpu_gemm.pack(w)
    policy = bf16_gemm_engine.policy
    got = cpu_gemm.silu_and_mul_linear(gate_up, packed, bias, policy=policy)
    want = cpu_gemm.linear(cpu_elementwise.silu_and_mul(gate_up), packed, bias, policy=policy)
    assert torch.equal(got, want)


@pytest.mark.parametrize("past_limit", [False, True])
def test_dispatch_fuses_the_gate_only_where_the_kernel_runs(
    monkeypatch, bf16_gemm_engine, past_limit
):
    kernels = dispatch.Kernels(bf16_gemm_engine.policy)
    rows = cpu_gemm.max_rows(kernels.policy) + past_limit
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(BF16)
    packed = dispatch.prepack_linear_weight((torch.randn(576, 1536, generator=gen) * 0.05).to(BF16))
    fused = []
    real = cpu_gemm.silu_and_mul_linear
    monkeypatch.setattr(
        cpu_gemm, "silu_and_mul_linear", lambda *a, **k: fused.append(a) or real(*a, **k)
    )
    got = kernels.silu_and_mul_linear(gate_up, packed)
    assert torch.equal(got, kernels.linear(kernels.silu_and_mul(gate_up), packed))
    assert len(fused) == (0 if past_limit else 1)


def test_vector_engine_gives_a_row_one_result_whatever_else_is_in_the_batch(monkeypatch):
    """The AVX512-BF16 engine sums a row in the same order at any row count it takes, so a
    sequence's logits do not depend on the batch beside it."""
    policy = bf16_engine(monkeypatch, "AVX512-BF16").policy
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    packed = cpu_gemm.pack(w)
    limit = cpu_gemm.max_rows(policy)
    batch = torch.randn(limit, 576, generator=gen).to(BF16)
    whole = cpu_gemm.linear(batch, packed, policy=policy)
    for rows in (1, 2, 3, 7, limit):
        assert torch.equal(cpu_gemm.linear(batch[:rows], packed, policy=policy), whole[:rows])

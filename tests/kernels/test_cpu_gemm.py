"""The AMX projection kernel for decode-sized row counts (kernels/cpu/cpu_gemm.c) against a float64
matmul, and the dispatch that sends a step's GEMMs to it or to oneDNN by row count."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import cpu_has_amx
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_elementwise, cpu_gemm, cpu_linear

BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def _need_amx():
    if not cpu_gemm.available():
        pytest.skip("this CPU or build has no AMX (test_amx_where_the_cpu_has_it checks which)")


def _bf16_exact(x, w, bias):
    """x · wᵀ + bias in float64 (exact for bf16 products), rounded once to bf16."""
    ref = x.double() @ w.double().T
    if bias is not None:
        ref += bias.double()
    return ref


def _assert_one_rounding(got, exact):
    """Every element is the bf16 rounding of the exact value or its neighbour (float32
    accumulation may land a value just across a rounding boundary), and nearly all are the
    rounding itself: a misplaced pair, column or row would be off by far more."""
    want = exact.to(BF16)
    ulp = (want.float().abs() * 2.0**-7).clamp_min(2.0**-126)
    assert ((got.float() - exact.float()).abs() <= ulp + 1e-6).all()
    assert (got == want).float().mean() > 0.97


def test_amx_where_the_cpu_has_it():
    """The kernel runs wherever the CPU has AMX-BF16, so the cases below cannot skip silently
    on such a machine."""
    assert cpu_gemm.available() == cpu_has_amx()


# Rows: a lone decode, a ragged tile, exactly one and two A tiles, a ragged second panel, a
# ragged third, one row past a row chunk (160 rows of A tiles at K 1536, 448 at K 576), and the
# largest count dispatch sends here (several chunks, the last ragged). Shapes: the bundled
# model's qkv, o, down; one pair of column tiles with the shortest K.
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 47, 65, 161, 449, cpu_gemm.MAX_ROWS])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (576, 1536), (32, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_the_rounded_exact_product(poison_allocations, rows, n, k, with_bias):
    _need_amx()
    gen = torch.Generator().manual_seed(rows * 7919 + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    got = cpu_gemm.linear(x, cpu_gemm.pack(w), bias)
    assert got.dtype == BF16 and got.shape == (rows, n)
    _assert_one_rounding(got, _bf16_exact(x, w, bias))


def test_amx_linear_reads_strided_rows_and_writes_nothing_else():
    """A view into a wider buffer (the q slice of a fused qkv output) is read at its stride."""
    _need_amx()
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 96, generator=gen).to(BF16)
    x = wide[:, 32:]
    w = torch.randn(64, 64, generator=gen).to(BF16)
    _assert_one_rounding(cpu_gemm.linear(x, cpu_gemm.pack(w)), _bf16_exact(x, w, None))


def test_amx_linear_rejects_a_mismatched_input():
    _need_amx()
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=BF16))
    with pytest.raises(
        ValueError, match=r"input \(4, 32\) torch.bfloat16 does not fit a bf16 weight of \[32, 64\]"
    ):
        cpu_gemm.linear(torch.zeros(4, 32, dtype=BF16), packed)
    with pytest.raises(ValueError, match=r"input \(4, 64\) torch.float32 does not fit"):
        cpu_gemm.linear(torch.zeros(4, 64), packed)


def test_amx_linear_of_no_rows_is_empty():
    _need_amx()
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=BF16))
    assert cpu_gemm.linear(torch.zeros(0, 64, dtype=BF16), packed).shape == (0, 32)


def test_pack_places_each_pair_where_the_tile_reads_it():
    """Tile (nb, kt), row r, lane 2c + p holds W[16·nb + c, 32·kt + 2r + p]."""
    w = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).to(BF16)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (4, 3, 16, 32)
    for nb, kt, r, c, p in [(0, 0, 0, 0, 0), (1, 2, 5, 3, 1), (3, 1, 15, 15, 0), (2, 2, 7, 9, 1)]:
        assert packed[nb, kt, r, 2 * c + p] == w[16 * nb + c, 32 * kt + 2 * r + p]


@pytest.mark.parametrize("rows", [1, cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1, 300])
def test_dispatch_sends_decode_rows_to_amx_and_the_rest_to_onednn(monkeypatch, rows):
    """Up to MAX_ROWS rows run the AMX kernel; more run oneDNN. Both round the exact product
    once (oneDNN's blocking, and so its summation order, changes with the row count: at 1025
    rows its packed weight and F.linear's plain one need not agree to the bit)."""
    _need_amx()
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    x = torch.randn(2, rows, 576, generator=gen).to(BF16)[0]
    packed = dispatch.prepack_linear_weight(w)
    assert isinstance(packed, cpu_linear.PackedLinear) and packed.tiles is not None
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a: calls.append(a) or real(*a))
    got = dispatch.linear(x, packed)
    assert len(calls) == (1 if rows <= cpu_gemm.MAX_ROWS else 0)
    _assert_one_rounding(got, _bf16_exact(x, w, None))


@pytest.mark.skipif(not cpu_linear._packs_bf16(), reason="bf16 weights are not packed here")
def test_shapes_the_kernel_does_not_take_stay_on_onednn():
    """Output features must pair up into 32-column units; others keep only oneDNN's layout."""
    w = torch.randn(48, 64).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    assert isinstance(packed, cpu_linear.PackedLinear) and packed.tiles is None
    x = torch.randn(3, 64).to(BF16)
    assert torch.equal(dispatch.linear(x, packed), F.linear(x, w))


def test_dispatch_gives_amx_strided_and_batched_inputs_their_shape():
    """A [batch, tokens, in] input, or one whose columns are strided, comes back shaped like
    x with out_features last."""
    _need_amx()
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 64, generator=gen) * 0.05).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    batched = torch.randn(2, 3, 64, generator=gen).to(BF16)
    got = dispatch.linear(batched, packed)
    assert got.shape == (2, 3, 64)
    _assert_one_rounding(got.reshape(6, 64), _bf16_exact(batched.reshape(6, 64), w, None))
    strided = torch.randn(5, 128, generator=gen).to(BF16)[:, ::2]
    _assert_one_rounding(dispatch.linear(strided, packed), _bf16_exact(strided, w, None))


@pytest.mark.parametrize("rows", [1, 17, 33, cpu_gemm.MAX_ROWS])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rms_norm_linear_gives_the_two_calls_bits(rows, with_residual, with_bias):
    """Normalising rows while packing them is the RMSNorm kernel then the GEMM, to the bit:
    the same output and the same updated residual."""
    _need_amx()
    gen = torch.Generator().manual_seed(rows + 2 * with_residual + with_bias)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    norm_w = (1 + 0.1 * torch.randn(576, generator=gen)).to(BF16)
    residual = torch.randn(rows, 576, generator=gen) if with_residual else None
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(960, generator=gen).to(BF16) if with_bias else None
    packed = cpu_gemm.pack(w)
    res_a = residual.clone() if with_residual else None
    res_b = residual.clone() if with_residual else None
    got, got_res = cpu_gemm.rms_norm_linear(x, norm_w, 1e-5, res_a, packed, bias)
    normed, want_res = cpu_elementwise.rms_norm(x, norm_w, 1e-5, res_b)
    assert torch.equal(got, cpu_gemm.linear(normed, packed, bias))
    assert torch.equal(got_res, want_res)
    if with_residual:
        assert got_res is res_a  # updated in place, as cpu_elementwise.rms_norm does


@pytest.mark.parametrize("rows", [cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1])
def test_dispatch_fuses_the_norm_only_where_the_amx_gemm_runs(monkeypatch, rows):
    _need_amx()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(BF16)
    norm_w = torch.ones(576).to(BF16)
    residual = torch.randn(rows, 576, generator=gen)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    fused = []
    real = cpu_gemm.rms_norm_linear
    monkeypatch.setattr(cpu_gemm, "rms_norm_linear", lambda *a: fused.append(a) or real(*a))
    got, got_res = dispatch.rms_norm_linear(x, norm_w, 1e-5, residual.clone(), packed)
    normed, want_res = dispatch.rms_norm(x, norm_w, 1e-5, residual.clone())
    assert torch.equal(got, dispatch.linear(normed, packed)) and torch.equal(got_res, want_res)
    assert len(fused) == (1 if rows <= cpu_gemm.MAX_ROWS else 0)


@pytest.mark.parametrize("rows", [1, 17, 33, cpu_gemm.MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_and_mul_linear_gives_the_two_calls_bits(rows, with_bias):
    """Gating rows while packing them is the silu-and-mul kernel then the GEMM, to the bit."""
    _need_amx()
    gen = torch.Generator().manual_seed(100 + rows + with_bias)
    gate_up = (torch.randn(2, rows, 2 * 1536, generator=gen) * 3).to(BF16)[1]  # any row stride
    w = (torch.randn(576, 1536, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(576, generator=gen).to(BF16) if with_bias else None
    packed = cpu_gemm.pack(w)
    got = cpu_gemm.silu_and_mul_linear(gate_up, packed, bias)
    want = cpu_gemm.linear(cpu_elementwise.silu_and_mul(gate_up), packed, bias)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1])
def test_dispatch_fuses_the_gate_only_where_the_amx_gemm_runs(monkeypatch, rows):
    _need_amx()
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(BF16)
    packed = dispatch.prepack_linear_weight((torch.randn(576, 1536, generator=gen) * 0.05).to(BF16))
    fused = []
    real = cpu_gemm.silu_and_mul_linear
    monkeypatch.setattr(cpu_gemm, "silu_and_mul_linear", lambda *a: fused.append(a) or real(*a))
    got = dispatch.silu_and_mul_linear(gate_up, packed)
    assert torch.equal(got, dispatch.linear(dispatch.silu_and_mul(gate_up), packed))
    assert len(fused) == (1 if rows <= cpu_gemm.MAX_ROWS else 0)

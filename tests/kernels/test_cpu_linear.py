"""Prepacked bf16 projections (kernels/cpu/cpu_linear.py) give F.linear's numbers, and dispatch
packs exactly the weights that gain from it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_features, cpu_linear
from kvfleet.kernels.policy import KernelPolicy

BF16 = torch.bfloat16
# Every row count on oneDNN, whichever cpu_gemm engine runs here.
ONEDNN_ONLY = dispatch.Kernels(KernelPolicy(amx_gemm_max_rows=0, avx512_bf16_gemm_max_rows=0))
KERNELS = dispatch.Kernels()  # the default kernel policy

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")
packs_bf16 = pytest.mark.skipif(
    not cpu_linear._packs_bf16(),
    reason="no oneDNN bf16 GEMM in this build, or the CPU only emulates bf16",
)


# Rows as a step sees them that oneDNN runs (fewer go to cpu_gemm where the CPU has AMX or
# AVX512-BF16, tested in test_cpu_gemm.py): one decode, an odd batch, a decode batch, a prefill chunk.
@packs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (100, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_gives_f_linear_numbers(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(BF16)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(BF16)
    b = torch.randn(out_features, generator=gen).to(BF16) if with_bias else None
    packed = dispatch.prepack_linear_weight(w)
    assert isinstance(packed, cpu_linear.PackedLinear) and packed.onednn.is_mkldnn
    got = ONEDNN_ONLY.linear(x, packed, b)
    assert got.dtype == BF16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=0)


@packs_bf16
def test_packed_linear_takes_strided_and_batched_inputs():
    # 48 output features: no tiles (test_cpu_gemm.py covers cpu_gemm's shapes), oneDNN.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen).to(BF16)
    packed = dispatch.prepack_linear_weight(w)
    wide = torch.randn(5, 128, generator=gen).to(BF16)
    strided = wide[:, ::2]  # every other column: not contiguous
    torch.testing.assert_close(KERNELS.linear(strided, packed), F.linear(strided, w))
    batched = torch.randn(2, 3, 64, generator=gen).to(BF16)
    got = KERNELS.linear(batched, packed)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got, F.linear(batched, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_keep_the_plain_weight(dtype):
    # Packing made no float32 or float16 GEMM faster here; float32 keeps HF parity exact.
    w = torch.randn(8, 16, dtype=dtype)
    assert dispatch.prepack_linear_weight(w) is w


@pytest.fixture
def emulated_bf16(monkeypatch):
    """A CPU without AVX512-BF16 or AMX (whatever this one has)."""
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    cpu_linear._packs_bf16.cache_clear()
    yield
    cpu_linear._packs_bf16.cache_clear()


def test_weights_stay_plain_where_bf16_is_emulated(emulated_bf16):
    # There the packed GEMM measured 5x slower than F.linear at one row.
    w = torch.randn(64, 64).to(BF16)
    assert dispatch.prepack_linear_weight(w) is w


def test_disabled_kernels_keep_the_plain_weight(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    w = torch.randn(8, 16).to(BF16)
    assert dispatch.prepack_linear_weight(w) is w
    x = torch.randn(3, 16).to(BF16)
    assert torch.equal(KERNELS.linear(x, w), F.linear(x, w))


@given(st.integers(min_value=1, max_value=1 << 16))
def test_row_buckets_pad_little(rows):
    """Padding is what buys kernel reuse: at most 15 rows or 1/16 more, onto multiples of 16."""
    padded = cpu_linear.padded_rows(rows)
    assert rows <= padded <= rows + max(15, rows // 16)
    assert padded % 16 == 0
    assert cpu_linear.padded_rows(padded) == padded  # a bucket is its own bucket


def test_a_servers_row_counts_share_few_kernels():
    """Every row count a step can have (up to 8192 batched tokens) lands in under 100 buckets:
    with five GEMM shapes per model that stays inside oneDNN's 1024-kernel cache."""
    assert len({cpu_linear.padded_rows(r) for r in range(1, 8193)}) < 100

"""The float32 decode-step GEMM (kernels/cpu/cpu_gemm_f32.c) against a float64 product, and the
dispatch that routes float32 steps of MIN_ROWS to the kernel policy's f32_gemm_max_rows rows to
it."""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import cpu_flags, record_rows
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm_f32, cpu_library
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy

# The most rows the default policy sends to the kernel.
MAX_ROWS = DEFAULT_POLICY.f32_gemm_max_rows
KERNELS = dispatch.Kernels()  # the default kernel policy

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


def _need_kernel():
    if not cpu_gemm_f32.available():
        pytest.skip("no AVX-512 or AVX2 here (test_runs_wherever_the_cpu_has_avx512_or_avx2 "
                    "checks which)")  # fmt: skip


def _width_here() -> int:
    flags = cpu_flags()
    return 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= set(flags) else 0


def test_runs_wherever_the_cpu_has_avx512_or_avx2():
    assert cpu_gemm_f32.lanes() == _width_here()
    assert cpu_gemm_f32.available() == (_width_here() > 0)


def assert_one_dot_rounding(got, x, w, bias=None):
    """Every element within 2^-18 of sum |x||w| (+ |bias|) of the exact result: float32
    summation in any order stays far inside; a wrong or missing term does not."""
    b = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    exact = x.double() @ w.double().T + b
    bound = (x.double().abs() @ w.double().abs().T + b.abs()) * 2**-18 + 1e-30
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


# Rows: the dot form (2, a partial 4-row tile, its last 16) and rows in lanes (17: one row past
# a vector; 32, 48, 64: two to four row vectors per panel; 100: two-vector passes and a tail),
# and the largest taken. Columns: one, a partial tile or panel, the bundled model's qkv and
# gate/up. K: one, a partial 16-wide step, the bundled model's 576 and 1536.
@pytest.mark.parametrize("rows", sorted({2, 7, 16, 17, 32, 48, 64, 100, MAX_ROWS}))
@pytest.mark.parametrize("n,k", [(1, 1), (6, 17), (960, 576), (576, 1536), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_exact_product(rows, n, k, with_bias):
    _need_kernel()
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    assert_one_dot_rounding(cpu_gemm_f32.linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("rows", [2, 4, 7, 8, 9, 16, 17, 24, 40, 100, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(1, 1), (6, 17), (13, 9), (960, 576)])
def test_the_avx2_form_matches_the_exact_product(avx2_build, rows, n, k):
    assert cpu_gemm_f32.lanes() == 8
    gen = torch.Generator().manual_seed(rows * n + k + 1)
    x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), None
    if rows % 2:
        bias = torch.randn(n, generator=gen)
    assert_one_dot_rounding(cpu_gemm_f32.linear(x, w, bias), x, w, bias)
    wide = torch.randn(rows, k + 11, generator=gen)
    strided = wide[:, 5 : 5 + k]  # a row stride that is not k
    assert_one_dot_rounding(cpu_gemm_f32.linear(strided, w), strided, w)
    assert KERNELS.linear_path(w, cpu_gemm_f32.MIN_ROWS) == dispatch.PATH_AVX2


def test_an_unknown_max_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_MAX_ISA", "avx1024")
    with pytest.raises(ValueError, match="KVFLEET_CPU_MAX_ISA: must be one of native, avx2"):
        cpu_library.build_flags()


def test_reads_strided_and_batched_inputs():
    """The model's q is a column slice of the fused qkv rows; an input may carry batch dims."""
    _need_kernel()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=gen)
    wide = torch.randn(9, 200, generator=gen)
    x = wide[:, 8:72]  # row stride 200
    assert_one_dot_rounding(cpu_gemm_f32.linear(x, w), x, w)
    batched = torch.randn(2, 3, 64, generator=gen)
    got = cpu_gemm_f32.linear(batched, w)
    assert got.shape == (2, 3, 40)
    assert_one_dot_rounding(got.reshape(6, 40), batched.reshape(6, 64), w)


def test_dispatch_routes_decode_sized_float32_steps(monkeypatch):
    _need_kernel()
    calls = record_rows(monkeypatch, cpu_gemm_f32, "linear")
    w = torch.randn(64, 32)
    lo, hi = cpu_gemm_f32.MIN_ROWS, MAX_ROWS
    assert lo == 1  # a single sequence's decode step too
    for rows in (lo, 2, 3, hi, hi + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(KERNELS.linear(x, w), F.linear(x, w))
    assert calls == [lo, 2, 3, hi]  # past the policy's limit stays on F.linear
    KERNELS.linear(torch.randn(8, 32).to(torch.bfloat16), w.to(torch.bfloat16))
    KERNELS.linear(torch.randn(8, 32), w.t().contiguous().t())  # a transposed weight view
    assert calls == [lo, 2, 3, hi]  # neither a bf16 step nor a strided weight goes to it


def test_a_policy_with_no_float32_rows_keeps_every_step_on_f_linear(monkeypatch):
    """f32_gemm_max_rows 0 turns the kernel off: projections run torch's, and say so."""
    _need_kernel()
    calls = record_rows(monkeypatch, cpu_gemm_f32, "linear")
    off = dispatch.Kernels(KernelPolicy(f32_gemm_max_rows=0))
    w = torch.randn(64, 32)
    for rows in (1, 7, MAX_ROWS):
        x = torch.randn(rows, 32)
        assert torch.equal(off.linear(x, w), F.linear(x, w))
        assert off.linear_path(w, rows) == dispatch.PATH_TORCH
        assert KERNELS.linear_path(w, rows) in (dispatch.PATH_AVX512_F32, dispatch.PATH_AVX2)
    assert calls == []


def test_disabled_kernels_keep_f_linear(monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    calls = record_rows(monkeypatch, cpu_gemm_f32, "linear")
    x, w = torch.randn(8, 32), torch.randn(64, 32)
    assert torch.equal(KERNELS.linear(x, w), F.linear(x, w))
    assert calls == []

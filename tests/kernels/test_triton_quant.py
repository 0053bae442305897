"""Triton GEMM through int4/int8/fp8 weights (triton_quant) against the exact product with the
dequantized weight (`quant_weight.dequantize`, the specification), in the CPU interpreter.
(TRITON_INTERPRET is set by conftest.py before triton is imported.)"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kvfleet.kernels.quant_weight import QuantizedWeight, dequantize, quantize_int4, unpack_int4
from kvfleet.kernels.triton import triton_quant

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# float32 sums in another order than the double reference, the scale applied to each tile's
# partial sum: within 2^-18 of sum |x| (|s q| + |o|). A wrong nibble, scale or offset is off by
# about |s x|, hundreds of times that.
F32_BOUND = 2.0**-18
# One rounding to x's dtype on top, up to a whole ulp: the interpreter truncates float32 ->
# bfloat16 casts where a GPU rounds to nearest.
ULP = {F32: 0.0, BF16: 2.0**-7, F16: 2.0**-10}
OUT_FEATURES = 96  # two N tiles, the second partial


def int4_weight(n: int, k: int, group: int, gen: torch.Generator, offsets: bool = True):
    w = quantize_int4(torch.randn(n, k, generator=gen), group)
    return w if offsets else dataclasses.replace(w, offsets=None)


def int8_weight(n: int, k: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    return QuantizedWeight("int8", q, scales, None, n, k, group)


def fp8_weight(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Per-channel fp8 (group = K), values across e4m3's range, subnormals included."""
    q = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-8, 6, (n, k), generator=gen)
    q = q.clamp(-448, 448).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q, torch.rand(n, 1, generator=gen) * 0.05 + 0.001, None, n, k, k)


def make_weight(fmt: str, n: int, k: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    if fmt == "int4":
        return int4_weight(n, k, group, gen)
    if fmt == "int4-no-offsets":
        return int4_weight(n, k, group, gen, offsets=False)
    if fmt == "int8":
        return int8_weight(n, k, group, gen)
    return fp8_weight(n, k, gen)


def _magnitudes(w: QuantizedWeight) -> torch.Tensor:
    """|s q| + |o| per weight, in double: what float32 rounding in the kernel scales with."""
    n, k, g = w.out_features, w.in_features, w.group_size
    q = unpack_int4(w.qweight) if w.format == "int4" else w.qweight
    mag = q.float().double().abs().view(n, k // g, g) * w.scales.double().abs().unsqueeze(-1)
    if w.offsets is not None:
        mag = mag + w.offsets.double().abs().unsqueeze(-1)
    return mag.reshape(n, k)


def assert_matches(got, x, w, bias=None):
    """got == x @ dequantize(w).T + bias within float32 summation error and one rounding to
    x's dtype, elementwise; also that the F.linear of the test's own recipe agrees."""
    x64 = x.double().reshape(-1, w.in_features)
    b = bias.double() if bias is not None else torch.zeros(w.out_features, dtype=torch.float64)
    exact = x64 @ dequantize(w).double().T + b
    allow = (x64.abs() @ _magnitudes(w).T + b.abs()) * F32_BOUND + 1e-30
    allow = allow + exact.abs() * ULP[x.dtype] + (2.0**-24 if x.dtype == F16 else 0.0)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.out_features)
    assert not got.isnan().any(), "an output element was not written, or read past an operand"
    err = (got.double().reshape(exact.shape) - exact).abs()
    worst = (err / allow).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the allowance (max error {err.max().item():.3g})"
    reference = F.linear(x.float(), dequantize(w, F32), bias if bias is None else bias.float())
    torch.testing.assert_close(got.float(), reference, **_tol(x.dtype))


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-3, rtol=1e-4) if dtype == F32 else dict(atol=2e-2, rtol=ULP[dtype] * 2)


def _cases():
    """Each format at rows 1, 3, 17 and 64 in float32 and bfloat16; bias, group size (32/128)
    and K split (the heuristic's, or forced off) follow an orthogonal array, so that for each
    format and dtype every pair of the three choices occurs."""
    cases = []
    for fmt in ("int4", "int4-no-offsets", "int8", "fp8"):
        for dtype in (F32, BF16):
            for i, rows in enumerate((1, 3, 17, 64)):
                bias, wide = i & 1, (i >> 1) ^ (dtype == BF16)
                group = 256 if fmt == "fp8" else (128 if wide else 32)
                split = None if bias ^ wide else 1
                cases.append((fmt, rows, group, dtype, bool(bias), split))
    return cases


CASES = _cases()


@pytest.mark.parametrize(
    "fmt,rows,group,dtype,bias,split_k",
    CASES,
    ids=[
        f"{c[0]}-m{c[1]}-g{c[2]}-{str(c[3])[6:]}{'-bias' if c[4] else ''}-"
        f"{'split' if c[5] is None else 'whole'}"
        for c in CASES
    ],
)
def test_linear_matches_dequantized_product(
    poison_allocations, fmt, rows, group, dtype, bias, split_k
):
    gen = torch.Generator().manual_seed(rows * 100 + group + len(fmt))
    k = 256
    w = make_weight(fmt, OUT_FEATURES, k, group, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(OUT_FEATURES, generator=gen) if bias else None
    cfg = triton_quant.choose_config(rows, w, triton_quant._FALLBACK_SMS, split_k)
    assert (cfg.split_k > 1) == (split_k is None), "the case does not take the path it names"

    got = triton_quant.linear(x, w, b, split_k=split_k)

    assert_matches(got, x, w, b)


@pytest.mark.parametrize(
    "fmt,k,group,dtype",
    [
        ("int4", 256, 32, BF16),
        ("int8", 256, 64, F32),
        ("fp8", 200, 200, BF16),  # K past the last full tile: its columns masked
        ("fp8", 200, 200, F32),
    ],
)
def test_x_a_column_slice_of_nan_padded_storage(poison_allocations, fmt, k, group, dtype):
    # x's row stride is not K; a load of a column outside the slice brings a NaN into the output.
    gen = torch.Generator().manual_seed(k + group)
    w = make_weight(fmt, OUT_FEATURES, k, group, gen)
    storage = torch.full((5, k + 40), float("nan"), dtype=dtype)
    storage[:, 24 : 24 + k] = torch.randn(5, k, generator=gen).to(dtype)
    x = storage[:, 24 : 24 + k]
    assert not x.is_contiguous()
    b = torch.randn(OUT_FEATURES, generator=gen)
    for split_k in (None, 1):
        assert_matches(triton_quant.linear(x, w, b, split_k=split_k), x, w, b)


@pytest.mark.parametrize("fmt", ["int4", "int4-no-offsets", "int8"])
def test_one_group_a_row_with_a_partial_last_tile(poison_allocations, fmt):
    # group = K = 160: scaled once after the loop, and 160 is not a multiple of the K tile (128),
    # so the int4 path's byte and nibble-order masks are exercised too.
    gen = torch.Generator().manual_seed(160)
    w = make_weight(fmt, 40, 160, 160, gen)
    x = torch.randn(3, 160, generator=gen)
    cfg = triton_quant.choose_config(3, w, 2)
    assert cfg.per_row and 160 % cfg.block_k
    assert_matches(triton_quant.linear(x, w), x, w)
    assert_matches(triton_quant.linear(x, w, split_k=1), x, w)


def test_group_not_a_power_of_two_and_a_split_of_uneven_slices(poison_allocations):
    # group 96: K tiles of 32; 6 tiles in 4 splits -> slices of 2, so 3 splits.
    gen = torch.Generator().manual_seed(96)
    w = int4_weight(OUT_FEATURES, 192, 96, gen)
    x = torch.randn(2, 192, generator=gen).to(BF16)
    cfg = triton_quant.choose_config(2, w, 2, split_k=4)
    assert (cfg.block_k, cfg.tiles_per_split, cfg.split_k) == (32, 2, 3)
    assert_matches(triton_quant.linear(x, w, split_k=4), x, w)


def test_leading_dimensions_float16_and_a_bfloat16_bias(poison_allocations):
    gen = torch.Generator().manual_seed(7)
    w = int8_weight(48, 128, 32, gen)
    x = torch.randn(2, 3, 128, generator=gen).to(F16)
    b = torch.randn(48, generator=gen).to(BF16)
    got = triton_quant.linear(x, w, b)
    assert got.shape == (2, 3, 48)
    assert_matches(got, x, w, b)


def test_no_rows():
    w = int8_weight(48, 128, 32, torch.Generator().manual_seed(0))
    assert triton_quant.linear(torch.zeros(0, 128), w).shape == (0, 48)


def test_launch_config():
    gen = torch.Generator().manual_seed(0)
    # Realistic sizes without building their tensors: the config reads only these fields.
    w = SimpleNamespace(format="int4", out_features=4096, in_features=4096, group_size=128)
    # A decode step on 132 SMs: 16-row tiles, 64 of them, so K is split into 5 slices of 7 of
    # its 32 tiles (about 2 programs an SM) and no slice is empty.
    cfg = triton_quant.choose_config(1, w, 132)
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (16, 64, 128)
    assert (cfg.split_k, cfg.tiles_per_split) == (5, 7)
    assert (cfg.split_k - 1) * cfg.tiles_per_split < 32 <= cfg.split_k * cfg.tiles_per_split
    # A prefill: 128 x 128 tiles, enough of them that K is not split.
    cfg = triton_quant.choose_config(4096, w, 132)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k) == (128, 128, 64, 1)
    for rows, block_m in [(16, 16), (17, 32), (33, 64), (65, 128)]:
        assert triton_quant.choose_config(rows, w, 132).block_m == block_m
    assert triton_quant.choose_config(1, w, 132, split_k=1000).split_k == 32
    fp8 = fp8_weight(8, 4000, gen)
    cfg = triton_quant.choose_config(1, fp8, 132)
    assert cfg.per_row and cfg.block_k == 128
    odd = QuantizedWeight("fp8", fp8.qweight, torch.ones(8, 500), None, 8, 4000, 8)
    with pytest.raises(ValueError, match="group_size 8 of a fp8 weight is not a multiple of 16"):
        triton_quant.linear(torch.zeros(1, 4000), odd)


@pytest.mark.parametrize(
    "x,bias,match",
    [
        (torch.zeros(2, 64), None, r"does not end in the weight's in_features 128"),
        (torch.zeros(2, 128, dtype=torch.int32), None, "x dtype torch.int32"),
        (torch.zeros(2, 128), torch.zeros(47), r"bias must be a float \[48\]"),
        (torch.zeros(2, 128), torch.zeros(48, dtype=torch.int64), "bias must be a float"),
        (torch.zeros(2, 128, device="meta"), None, "x is on meta, the weight on cpu"),
    ],
)
def test_argument_errors(x, bias, match):
    w = int8_weight(48, 128, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=match):
        triton_quant.linear(x, w, bias)
    with pytest.raises(TypeError, match="must be a QuantizedWeight"):
        triton_quant.linear(torch.zeros(2, 128), dequantize(w))

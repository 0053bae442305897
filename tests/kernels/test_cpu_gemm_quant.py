"""The CPU GEMM through 4-bit and 8-bit weights (kernels/cpu/cpu_gemm_quant.c) against the
exact product with the dequantized weight (`quant_weight.dequantize`, the specification), its
dequantize pass, and the dispatch that sends decode-sized float32 steps to it and larger ones
through the dequantized weight."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_gemm_quant
from kvfleet.kernels.policy import DEFAULT_POLICY
from kvfleet.kernels.quant_weight import (
    QuantizedWeight,
    concat_out,
    dequantize,
    pack_int4,
    quantize_int4,
    to_blocked,
    to_rows,
    unpack_int4,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")
KERNELS = dispatch.Kernels()
# Row counts: every tile shape (4, 2 and 1-row tiles) and a step past the kernel's row chunk of 64.
ROWS = sorted({1, 2, 3, 4, 5, 6, 7, 8, 17, 70})


def _need_kernel():
    if not cpu_gemm_quant.available():
        pytest.skip("no AVX-512 or AVX2 here: the float32 GEMM's tests say which")


def int8_weight(n: int, k: int, group: int, gen: torch.Generator) -> QuantizedWeight:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    return QuantizedWeight("int8", q, scales, None, n, k, group)


def int4_weight(n: int, k: int, group: int, gen: torch.Generator, offsets: bool = True):
    w = quantize_int4(torch.randn(n, k, generator=gen), group)
    return w if offsets else dataclasses.replace(w, offsets=None)


def assert_one_dot_rounding(got, x, w, bias=None):
    """Within what the kernel's rounding allows of the exact product with the dequantized
    weight: each activation rounded to a 16-bit integer of its run of 32 (at most half a step,
    the run's largest magnitude / 32767 / 2, times |w|), plus float32 sums (2^-18 of
    sum |x||w| + |bias|). A wrong nibble, scale or offset lands far outside."""
    wd = dequantize(w).double()
    xd = x.double().reshape(-1, x.shape[-1])
    b = bias.double() if bias is not None else torch.zeros(w.out_features, dtype=torch.float64)
    exact = xd @ wd.T + b
    run_max = xd.abs().view(xd.shape[0], -1, 32).amax(-1, keepdim=True)
    step = (run_max / 32767 / 2).expand(-1, -1, 32).reshape(xd.shape)
    bound = step @ wd.abs().T + (xd.abs() @ wd.abs().T + b.abs()) * 2**-18 + 1e-30
    assert got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_int4_layout_round_trips_in_gguf_order():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = pack_int4(q)
    # Byte j of a 32-weight run: weight j in the low nibble, weight j + 16 in the high one.
    assert packed[0, 0].item() == (0 | (16 % 16) << 4) and packed[0, 1].item() == (1 | 1 << 4)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", ["int4", "int4-symmetric", "int8"])
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (13, 64, 32), (960, 576, 32), (72, 1536, 128)])
def test_matches_the_dequantized_product(rows, fmt, n, k, group):
    _need_kernel()
    gen = torch.Generator().manual_seed(rows * n + k)
    if fmt == "int8":
        w = int8_weight(n, k, group, gen)
    else:
        w = int4_weight(n, k, group, gen, offsets=fmt == "int4")
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    got = cpu_gemm_quant.linear(x, cpu_gemm_quant.pack(w), bias)
    assert_one_dot_rounding(got, x, w, bias)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n", [1, 13, 16, 40])
def test_the_blocked_layout_holds_the_same_weight(fmt, n):
    """Packing reorders bytes and pads the last block: the weight it stands for is the same,
    and unpacking gives back the row layout's bytes."""
    gen = torch.Generator().manual_seed(n)
    w = int4_weight(n, 128, 64, gen) if fmt == "int4" else int8_weight(n, 128, 32, gen)
    for block in (8, 16):
        packed = to_blocked(w, block)
        assert packed.qweight.shape[0] == -(-n // block)
        assert torch.equal(dequantize(packed), dequantize(w))
        back = to_rows(packed)
        assert torch.equal(back.qweight, w.qweight) and torch.equal(back.scales, w.scales)
    with pytest.raises(ValueError, match="to_blocked"):
        to_blocked(packed, 16)


def test_reads_rows_with_a_stride_and_leading_dimensions():
    _need_kernel()
    gen = torch.Generator().manual_seed(3)
    w = int4_weight(40, 64, 32, gen)
    packed = cpu_gemm_quant.pack(w)
    wide = torch.randn(2, 3, 100, generator=gen)
    x = wide[..., 10:74]  # rows 100 apart, the last dimension contiguous
    got = cpu_gemm_quant.linear(x, packed)
    assert got.shape == (2, 3, 40)
    assert_one_dot_rounding(got.reshape(6, 40), x.reshape(6, 64), w)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n", [33, 48])
def test_dequantize_pass_gives_the_specifications_values(fmt, n):
    _need_kernel()
    gen = torch.Generator().manual_seed(5)
    w = int4_weight(n, 256, 128, gen) if fmt == "int4" else int8_weight(n, 256, 32, gen)
    got = cpu_gemm_quant.dequantized(cpu_gemm_quant.pack(w), torch.float32)
    assert torch.equal(got, dequantize(w))


@pytest.mark.parametrize("limit", [8, 20])
def test_dispatch_routes_by_rows_and_matches_across_the_limit(limit):
    _need_kernel()
    gen = torch.Generator().manual_seed(9)
    w = cpu_gemm_quant.pack(int4_weight(96, 128, 32, gen))
    policy = dataclasses.replace(
        DEFAULT_POLICY, quant_gemm_max_rows=limit, vnni_quant_gemm_max_rows=limit
    )
    kernels = dispatch.Kernels(policy)
    assert cpu_gemm_quant.max_rows(policy) == limit
    for rows in (1, limit, limit + 1):
        path = kernels.linear_path(w, rows)
        assert (path == dispatch.PATH_DEQUANTIZED) == (rows > limit)
        x = torch.randn(rows, 128, generator=gen)
        assert_one_dot_rounding(kernels.linear(x, w), x, w)


def test_a_model_s_cpu_weights_are_packed_once_at_load():
    _need_kernel()
    w = int4_weight(40, 64, 32, torch.Generator().manual_seed(2))
    packed = dispatch.prepack_linear_weight(w)
    assert packed.block == cpu_gemm_quant.block_columns() > 0
    assert cpu_gemm_quant.pack(packed) is packed
    assert torch.equal(dequantize(packed), dequantize(w))


def test_prepack_keeps_the_row_layout_for_triton_and_triton_refuses_blocks():
    _need_kernel()
    w = int4_weight(40, 64, 32, torch.Generator().manual_seed(4))
    triton_policy = dataclasses.replace(DEFAULT_POLICY, backend="triton")
    assert dispatch.prepack_linear_weight(w, policy=triton_policy).block == 0
    with pytest.raises(ValueError, match="weight: packed in column blocks"):
        dispatch.Kernels(triton_policy).linear(torch.randn(2, 64), cpu_gemm_quant.pack(w))


def test_bf16_rows_get_bf16_results_of_the_float32_product():
    _need_kernel()
    gen = torch.Generator().manual_seed(11)
    w = int4_weight(64, 64, 32, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    got = KERNELS.linear(x, cpu_gemm_quant.pack(w))
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), dequantize(w)).to(torch.bfloat16)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_fused_projections_stack_their_rows():
    gen = torch.Generator().manual_seed(13)
    parts = [int4_weight(n, 64, 32, gen) for n in (32, 8, 8)]
    fused = concat_out(parts)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    with pytest.raises(ValueError, match="different layouts"):
        concat_out([parts[0], int8_weight(8, 64, 32, gen)])


@pytest.mark.parametrize(
    "change,field",
    [
        ({"group_size": 48}, "group_size"),
        ({"scales": torch.zeros(4, 3)}, "scales"),
        ({"format": "int3"}, "format"),
    ],
)
def test_a_malformed_weight_names_its_field(change, field):
    gen = torch.Generator().manual_seed(1)
    w = int4_weight(4, 64, 32, gen)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(w, **change)

"""The Triton GEMM through int4/int8/fp8 weights (kernels/triton/triton_quant.py) compiled for a
CUDA GPU at a model's sizes: against the exact product with the dequantized weight, split and
whole K, strided x, CUDA-graph replay, and a decode step against cuBLAS on the bf16 weight.
Skipped where torch sees no GPU (CI has none); on a lent GPU run `pytest tests/gpu`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
N = K = 4096
# float32 accumulation over K = 4096 in tiles and splits, against a double reference: within
# 2^-16 of sum |x| (|s q| + |o|); one rounding to x's dtype on top (half an ulp on a GPU).
F32_BOUND = 2.0**-16
HALF_ULP = {F32: 0.0, BF16: 2.0**-8, F16: 2.0**-11}


def _weight(fmt: str, gen: torch.Generator, group: int = 128):
    from kvfleet.kernels.quant_weight import QuantizedWeight, quantize_int4

    dev = "cuda"
    if fmt.startswith("int4"):
        w = quantize_int4(torch.randn(N, K, generator=gen, device=dev) * 0.02, group)
        return w if fmt == "int4" else dataclasses.replace(w, offsets=None)
    if fmt == "int8":
        q = torch.randint(-128, 128, (N, K), generator=gen, device=dev, dtype=torch.int8)
        scales = torch.rand(N, K // group, generator=gen, device=dev) * 2e-4 + 1e-5
        return QuantizedWeight("int8", q, scales, None, N, K, group)
    q = (torch.randn(N, K, generator=gen, device=dev) * 16).to(torch.float8_e4m3fn)
    scales = torch.rand(N, 1, generator=gen, device=dev) * 1e-3 + 1e-4
    return QuantizedWeight("fp8", q, scales, None, N, K, K)


def _assert_matches(got, x, w, bias=None):
    from kvfleet.kernels.quant_weight import dequantize, unpack_int4

    x64 = x.double().reshape(-1, K)
    b = bias.double() if bias is not None else torch.zeros(N, dtype=torch.float64, device="cuda")
    exact = x64 @ dequantize(w).double().T + b
    q = unpack_int4(w.qweight) if w.format == "int4" else w.qweight
    g = w.group_size
    mag = q.float().abs().view(N, K // g, g) * w.scales.abs().unsqueeze(-1)
    if w.offsets is not None:
        mag = mag + w.offsets.abs().unsqueeze(-1)
    allow = (x64.abs() @ mag.reshape(N, K).double().T + b.abs()) * F32_BOUND + 1e-30
    allow = allow + exact.abs() * HALF_ULP[x.dtype] + (2.0**-24 if x.dtype == F16 else 0.0)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], N)
    assert not got.isnan().any()
    err = (got.double().reshape(exact.shape) - exact).abs()
    worst = (err / allow).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the allowance (max error {err.max().item():.3g})"


@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt", ["int4", "int4-no-offsets", "int8", "fp8"])
def test_linear_matches_the_dequantized_product(fmt, dtype, rows):
    from kvfleet.kernels.triton import triton_quant

    gen = torch.Generator(device="cuda").manual_seed(rows + len(fmt))
    w = _weight(fmt, gen)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(N, generator=gen, device="cuda").to(dtype)
    _assert_matches(triton_quant.linear(x, w, bias), x, w, bias)
    _assert_matches(triton_quant.linear(x, w), x, w)


@pytest.mark.parametrize("group", [32, 64, 4096])
def test_split_and_whole_k_at_every_group_size(group):
    from kvfleet.kernels.triton import triton_quant

    gen = torch.Generator(device="cuda").manual_seed(group)
    w = _weight("int4", gen, group)
    x = torch.randn(4, K, generator=gen, device="cuda").to(BF16)
    split = triton_quant.linear(x, w)
    assert triton_quant.choose_config(4, w, triton_quant._num_sms(x.device)).split_k > 1
    _assert_matches(split, x, w)
    _assert_matches(triton_quant.linear(x, w, split_k=1), x, w)
    # The splits are added in a fixed order: the same bits every call.
    assert torch.equal(split, triton_quant.linear(x, w))


def test_x_a_column_slice_of_a_fused_activation():
    from kvfleet.kernels.triton import triton_quant

    gen = torch.Generator(device="cuda").manual_seed(3)
    w = _weight("int4", gen)
    wide = torch.full((16, K + 512), float("nan"), dtype=BF16, device="cuda")
    wide[:, 256 : 256 + K] = torch.randn(16, K, generator=gen, device="cuda").to(BF16)
    x = wide[:, 256 : 256 + K]
    _assert_matches(triton_quant.linear(x, w), x, w)


def test_cuda_graph_replay_gives_the_eager_numbers():
    from kvfleet.kernels.triton import triton_quant

    gen = torch.Generator(device="cuda").manual_seed(4)
    w = _weight("int4", gen)
    x = torch.randn(8, K, generator=gen, device="cuda").to(BF16)
    eager = triton_quant.linear(x, w)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_quant.linear(x, w)
    x.copy_(torch.randn(8, K, generator=gen, device="cuda").to(BF16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, triton_quant.linear(x, w))
    assert not torch.equal(captured, eager)


def _graph_time_us(fn, calls: int = 50) -> float:
    """Microseconds a call of `fn` takes replayed from a CUDA graph (no launch overhead, as in
    the engine's decode steps), the median of several replays."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_a_decode_step_reads_fewer_bytes_and_beats_cublas_on_bf16(fmt):
    """One row through a 4096 x 4096 projection: a weight-bound step, where the 4- and 8-bit
    weights must beat cuBLAS on the bf16 weight (2 bytes a weight). Prints the numbers."""
    from kvfleet.kernels.quant_weight import dequantize
    from kvfleet.kernels.triton import triton_quant

    gen = torch.Generator(device="cuda").manual_seed(5)
    w = _weight(fmt, gen)
    x = torch.randn(1, K, generator=gen, device="cuda").to(BF16)
    dense = dequantize(w, BF16)
    quant_us = _graph_time_us(lambda: triton_quant.linear(x, w))
    dense_us = _graph_time_us(lambda: F.linear(x, dense))
    cfg = triton_quant.choose_config(1, w, triton_quant._num_sms(x.device))
    print(
        f"\n{torch.cuda.get_device_name()} {fmt} 1 x {K} x {N}: {quant_us:.1f} us "
        f"({w.nbytes() / quant_us / 1e3:.0f} GB/s, split {cfg.split_k}), cuBLAS bf16 "
        f"{dense_us:.1f} us ({dense.numel() * 2 / dense_us / 1e3:.0f} GB/s)"
    )
    assert quant_us < dense_us

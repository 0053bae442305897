"""`kvfleet bench cpu-kernels`' quantized rows, where the quantized kernel builds: a step's
projections through 4-bit weights (the bundled model's shapes, int4 in groups of 32 with
offsets, as its Q4_1 file holds them; an int8 LM head, as its Q8_0 one) on `cpu_gemm_quant`,
against the same weights dequantized per call into the float32 GEMM: the path past the kernel
policy's row limit, so each row says on which side of it that row count belongs."""

from __future__ import annotations

from dataclasses import replace

from kvfleet.kernels.bench.cpu_kernels_cases import (
    HIDDEN,
    INTERMEDIATE,
    alternating_min_ms,
    step_weights,
    verify,
)
from kvfleet.kernels.bench.cpu_kernels_report import Float32Row
from kvfleet.kernels.policy import DEFAULT_POLICY

# The kernel rounds activations to int16 per 32 values (cpu_gemm_quant.c): ~1e-4 of these
# outputs; a wrong nibble or scale is off by far more.
QUANT_VERIFY_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}
# The policy with the kernel's row limits at 0: every projection dequantized per call.
DEQUANTIZED = replace(DEFAULT_POLICY, quant_gemm_max_rows=0, vnni_quant_gemm_max_rows=0)


def _int8(torch, w):
    """w [n, k] as the kernels' int8 format: per 32 weights, a scale of max |w| / 127."""
    from kvfleet.kernels.quant_weight import RUN, QuantizedWeight

    n, k = w.shape
    groups = w.reshape(n, k // RUN, RUN)
    scales = (groups.abs().amax(-1) / 127).clamp_min(1e-8)
    q = (groups / scales.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return QuantizedWeight("int8", q.reshape(n, k), scales.contiguous(), None, n, k, RUN)


def step_weights_quantized(torch, layers: int) -> list:
    """A step's weights packed as a model loads them: `layers` layers' int4 projections and an
    int8 LM head."""
    from kvfleet.kernels.cpu import cpu_gemm_quant
    from kvfleet.kernels.quant_weight import RUN, quantize_int4

    plain = step_weights(torch, layers, torch.float32)
    quantized = [quantize_int4(w, RUN) for w in plain[:-1]] + [_int8(torch, plain[-1])]
    return [cpu_gemm_quant.pack(w) for w in quantized]


def quant_row(torch, rows: int, weights: list, iters: int) -> Float32Row:
    """A step's quantized projections at `rows` rows: the kernel (called directly, also past the
    rows the policy sends it, to show the crossover) against dequantizing per call."""
    from kvfleet.kernels import dispatch
    from kvfleet.kernels.cpu import cpu_gemm_quant

    dequantized = dispatch.Kernels(DEQUANTIZED)
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
    for w in weights[:4] + weights[-1:]:
        x = inputs[w.in_features]
        verify(torch, f"quantized {w.format} projection {w.shape} at {rows} rows",
               cpu_gemm_quant.linear(x, w), dequantized.linear(x, w),
               QUANT_VERIFY_TOLERANCE)  # fmt: skip

    def step(fn):
        return lambda: [fn(inputs[w.in_features], w) for w in weights]

    dequantized_ms, kernel_ms = alternating_min_ms(
        [step(dequantized.linear), step(cpu_gemm_quant.linear)], iters
    )
    weight_bytes = sum(w.nbytes() for w in weights)
    flops = 2 * rows * sum(w.out_features * w.in_features for w in weights)
    return Float32Row(
        f"rows={rows}",
        dequantized_ms,
        kernel_ms,
        dequantized_ms / kernel_ms,
        flops / (kernel_ms * 1e-3) / 1e12,
        weight_bytes / (kernel_ms * 1e-3) / 1e9,
    )

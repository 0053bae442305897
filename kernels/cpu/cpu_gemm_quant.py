"""Projections through 4-bit and 8-bit weights on CPU (kernels/cpu/cpu_gemm_quant.c): float32
steps up to the policy's rows read the packed weight and widen it to int16 in registers, so a
step streams the quantized bytes (the bundled model's Q4_1 layers: 0.75 bytes a weight as held
here, against 4 in float32); larger steps dequantize the weight once per call, in C, into a
reused buffer for the float32 GEMM, where the multiply outweighs that pass (AVX2 past 8 rows).
Weights are repacked at load into the kernel's column blocks (`pack`). The kernel rounds each
activation to a 16-bit integer of its run of 32 (see the C file): results differ from the
float32 GEMM on the dequantized weight (`quant_weight.dequantize`) by far less than bf16
activations would, by more than float32 summation order alone."""

from __future__ import annotations

import ctypes
import functools

import torch
from kvfleet.kernels.cpu import cpu_gemm_f32, cpu_library
from kvfleet.kernels.policy import KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight, dequantize, to_blocked

# cpu_entry_points.h's QUANT_* codes: the formats the C kernel reads (fp8 has no CPU kernel:
# no x86 CPU here computes in it, so its weights are dequantized at load).
_FORMAT_CODES = {"int4": 0, "int8": 1}


class QuantWeightStruct(ctypes.Structure):
    """cpu_entry_points.h's QuantWeight: pointers into a `QuantizedWeight`'s tensors."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("format", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("block", ctypes.c_int32),
    ]


def available() -> bool:
    """Whether the kernel runs here: the C library builds, with AVX-512 or AVX2 + FMA (the same
    builds as the float32 GEMM's)."""
    return cpu_gemm_f32.available()


@functools.cache
def _build_facts(library: object) -> tuple[int, bool]:
    """A loaded library's block width and whether its dot is fused: asked once per build, since
    every projection's routing asks them."""
    return library.kvfleet_quant_block(), bool(library.kvfleet_quant_fused_dot())


def block_columns() -> int:
    """Columns per block of the blocked layout this build's kernel reads (its vector width: 16
    with AVX-512, 8 with AVX2); 0 where the kernel does not run."""
    return _build_facts(cpu_library.library())[0] if available() else 0


def fused_dot() -> bool:
    """Whether this build's kernel adds products with AVX-512 VNNI's fused dot."""
    return available() and _build_facts(cpu_library.library())[1]


def max_rows(policy: KernelPolicy) -> int:
    """The most rows a projection may have to run on the kernel under `policy`: its row limit
    for this build's dot (vnni_quant_gemm_max_rows with the fused dot, else quant_gemm_max_rows)."""
    return policy.vnni_quant_gemm_max_rows if fused_dot() else policy.quant_gemm_max_rows


def _readable(weight: object) -> bool:
    return (
        isinstance(weight, QuantizedWeight)
        and weight.format in _FORMAT_CODES
        and weight.device.type == "cpu"
        and block_columns() > 0
    )


def supports(weight: object) -> bool:
    """A CPU weight the C kernels read: int4 or int8, packed for this build (`pack`)."""
    return _readable(weight) and weight.block == block_columns()


def pack(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` in the column blocks of this build's kernel (the C file says why and how), or
    unchanged where the kernel does not read its format. Call once, at load."""
    if weight.block or not _readable(weight):
        return weight
    return to_blocked(weight, block_columns())


def c_struct(weight: QuantizedWeight) -> QuantWeightStruct:
    """The struct the C kernels take for `weight` (which must outlive it); made once per
    weight and kept on it, since a step passes each weight many times."""
    if weight.native is None:
        weight.native = QuantWeightStruct(
            weight.qweight.data_ptr(),
            weight.scales.data_ptr(),
            weight.offsets.data_ptr() if weight.offsets is not None else None,
            _FORMAT_CODES[weight.format],
            weight.group_size,
            weight.block,
        )
    return weight.native


def takes(x: torch.Tensor, weight: QuantizedWeight, *, policy: KernelPolicy) -> bool:
    """Whether `linear(x, weight)` runs the in-register kernel under `policy`: float32 CPU rows
    with a contiguous last dimension, 1 to `max_rows(policy)` of them."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and x.shape[-1] == weight.in_features
        and 1 <= rows <= max_rows(policy)
        and supports(weight)
    )


def linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ dequantize(weight).T + bias for float32 x [..., in_features]; callers check
    `takes`. bias: float32 [out_features] or None."""
    flat = x.reshape(-1, x.shape[-1])
    rows, n, k = flat.shape[0], weight.out_features, weight.in_features
    out = torch.empty(rows, n, dtype=torch.float32)
    if bias is not None:
        bias = bias.float().contiguous()
    status = cpu_library.library().kvfleet_linear_quant(
        flat.data_ptr(), flat.stride(0), ctypes.byref(c_struct(weight)),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(), out.stride(0), rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"quantized linear kernel failed with status {status} for x {tuple(x.shape)} and a "
            f"{weight.format} weight {weight.shape} (group {weight.group_size})"
        )
    return out.view(*x.shape[:-1], n)


_scratch: list[torch.Tensor] = []


def _scratch_buffer(numel: int) -> torch.Tensor:
    """A float32 buffer of at least `numel` elements, reused from call to call: a fresh one per
    projection would fault in its pages every step."""
    if not _scratch or _scratch[0].numel() < numel:
        _scratch[:] = [torch.empty(numel, dtype=torch.float32)]
    return _scratch[0][:numel]


def dequantized(weight: QuantizedWeight, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
    """The plain [out, in] weight in `dtype`: by the C kernel where it runs (one pass, both
    cores), else by the torch reference; the same float32 values either way. `scratch`: into
    one buffer the next such call overwrites (for a GEMM that consumes it at once; one
    forward at a time per process)."""
    if not (supports(weight) and available()):
        return dequantize(weight, dtype)
    n, k = weight.out_features, weight.in_features
    out = _scratch_buffer(n * k).view(n, k) if scratch else torch.empty(n, k)
    status = cpu_library.library().kvfleet_dequantize(
        ctypes.byref(c_struct(weight)), out.data_ptr(), weight.out_features,
        weight.in_features, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"dequantize kernel failed with status {status}")
    return out if dtype == torch.float32 else out.to(dtype)

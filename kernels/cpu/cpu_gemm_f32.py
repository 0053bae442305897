"""float32 projections of decode-sized steps on AVX-512 or AVX2 + FMA (kernels/cpu/cpu_gemm_f32.c,
one source built for whichever the CPU has), reading the
plain [out_features, in_features] weight in place: where float32 is the CPU default (no
AVX512-BF16), MKL's GEMM behind F.linear repacks the weight on every call, which at a few dozen
rows costs as much as the multiply. Up to 16 rows the kernel sums along K in vectors (dot
form); above, it transposes the few rows of x once and keeps 16 rows per vector (rows in
lanes). Larger steps stay on F.linear, near the machine's float32 peak there. Same numbers up
to float32 summation order."""

from __future__ import annotations

import functools

import torch
from kvfleet.kernels.cpu import cpu_library
from kvfleet.kernels.policy import KernelPolicy

# The fewest rows the kernel takes. 1-3 rows stayed on MKL's GEMV on an Intel host, which
# streamed the weight faster than the dot form did while it read NR weight rows side by side; it
# reads them one after the other now, at the rate a plain read of the same bytes gets (34-38
# GB/s on a 2-core Zen 4, where MKL took 2.9x longer at one row and 5.7x at two and three; AVX2
# builds likewise: MKL held to AVX2 streamed the weights at 13 GB/s at one row). So every row
# count from one takes it, and with it the fused decode step. The most rows it takes is the
# kernel policy's `f32_gemm_max_rows`, with the measurements behind it.
MIN_ROWS = 1


def lanes() -> int:
    """The vector width the kernel runs at here: 16 (AVX-512), 8 (AVX2 + FMA), 0 (it does not
    run: no library, or a CPU with neither)."""
    if not cpu_library.available():
        return 0
    return _lanes(cpu_library.library())


@functools.cache
def _lanes(lib: object) -> int:
    # Keyed by the loaded library: a rebuilt one (tests change its flags) asks again.
    return int(lib.kvfleet_linear_f32_lanes())


def available() -> bool:
    """Whether the kernel runs here: the C library builds, with AVX-512 or AVX2 + FMA."""
    return lanes() > 0


def min_rows() -> int:
    """The fewest rows the kernel takes (fewer stay on F.linear): MIN_ROWS, on AVX-512 and
    AVX2 alike."""
    return MIN_ROWS


def takes(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> bool:
    """Whether `linear(x, weight, bias)` runs on this kernel under `policy`: float32 CPU
    tensors, a contiguous 2-D weight, x's last dimension contiguous, `min_rows()` to the
    policy's `f32_gemm_max_rows` rows."""
    if not (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and x.stride(-1) == 1
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    ):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return rows <= policy.f32_gemm_max_rows and available() and rows >= min_rows()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 x [..., in_features]; callers check `takes`."""
    flat = x.reshape(-1, x.shape[-1])
    rows, (n, k) = flat.shape[0], weight.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    status = cpu_library.library().kvfleet_linear_f32(
        flat.data_ptr(), flat.stride(0), weight.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(), out.stride(0), rows, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"float32 linear kernel failed with status {status} for x {tuple(x.shape)}"
        )
    return out.view(*x.shape[:-1], n)

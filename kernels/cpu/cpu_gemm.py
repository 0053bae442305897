"""bf16 projections of decode-sized steps (kernels/cpu/cpu_gemm.c) on one packed weight layout with
two engines: AMX tiles, and on CPUs with AVX512-BF16 but no AMX, AVX-512 vectors (`vdpbf16ps`,
columns in lanes). A decode step's GEMMs, and on AMX those of a step that carries a prompt of a
few hundred tokens beside the decodes.

At decode-sized row counts a projection streams its weight once and does little arithmetic per
byte; oneDNN's kernels for those shapes read the weight well below the rate the host can stream
(`kvfleet bench cpu-kernels`: the AMX engine is 1.05-1.7x faster up to 96 rows; on a 2-core
Zen 4 host oneDNN read 12-13 GB/s at 1-8 rows where the vector engine reads 23-28). At a few
hundred rows oneDNN's kernels for the bundled model's narrow shapes (576-3072 columns) fall to
0.8-1.4 TFLOP/s, where the AMX engine keeps L2-sized row chunks against weight pairs in L1. Both
engines read weights prepacked (`pack`) into the byte order of AMX B tiles, in the order they
use them. Same numbers as oneDNN up to float32 summation order: all multiply bf16 pairs exactly
and accumulate in float32, and all round the result to bf16 once.

Which engine runs, and up to how many rows, is the caller's `KernelPolicy` (`allow_amx`, the
row limits `amx_gemm_max_rows` and `avx512_bf16_gemm_max_rows`, with the measurements behind
them); what this CPU can run is probed once.
"""

from __future__ import annotations

import functools

import torch
from kvfleet.kernels.cpu import cpu_library
from kvfleet.kernels.cpu.huge_pages import HugePageArena
from kvfleet.kernels.policy import KernelPolicy

# Columns are split between threads in pairs of 16-wide tiles; inputs come 32 per tile row.
COLUMN_MULTIPLE, INNER_MULTIPLE = 32, 32
# cpu_gemm.c's engines.
KERNEL_AMX, KERNEL_AVX512_BF16 = 0, 1


@functools.cache
def _amx_present() -> bool:
    return bool(cpu_library.library().kvfleet_linear_amx())


@functools.cache
def _vectors_present() -> bool:
    return bool(cpu_library.library().kvfleet_linear_avx512_bf16())


def amx_available() -> bool:
    """Whether the AMX engine runs here: the C library built for AMX and the tile state granted."""
    return cpu_library.available() and _amx_present()


def vectors_available() -> bool:
    """Whether the AVX512-BF16 vector engine runs here: the library built for AVX512-BF16."""
    return cpu_library.available() and _vectors_present()


def kernel(policy: KernelPolicy) -> int | None:
    """The engine decode-sized bf16 projections run on here under `policy` (KERNEL_AMX where
    the CPU has AMX and the policy allows it, else KERNEL_AVX512_BF16), or None where neither
    runs."""
    if policy.allow_amx and amx_available():
        return KERNEL_AMX
    return KERNEL_AVX512_BF16 if vectors_available() else None


def available() -> bool:
    """Whether either engine runs here (weights are packed for it whatever a policy allows)."""
    return amx_available() or vectors_available()


def max_rows(policy: KernelPolicy) -> int:
    """The most rows a step may have for its projections to run here under `policy`: the row
    limit of the engine it picks (0 where none runs)."""
    engine = kernel(policy)
    if engine is None:
        return 0
    return policy.amx_gemm_max_rows if engine == KERNEL_AMX else policy.avx512_bf16_gemm_max_rows


def supports(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this [out_features, in_features] weight: bf16 on CPU, with
    out_features a multiple of 32 and in_features a multiple of 32."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % COLUMN_MULTIPLE == 0
        and weight.shape[1] % INNER_MULTIPLE == 0
    )


def pack(weight: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: per 16-column block and 32-deep K step, one B tile whose
    row r holds each column's pair of inputs (2r, 2r+1) side by side; in `arena` if given."""
    n, k = weight.shape
    tiles = weight.detach().reshape(n // 16, 16, k // 32, 16, 2)  # [nb, c, kt, r, pair]
    tiles = tiles.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)
    return arena.copy(tiles) if arena is not None else tiles.contiguous()


# What the kernel does to each input row while packing it (cpu_gemm.c's PROLOGUE_*).
_PLAIN, _RMS_NORM, _SILU_AND_MUL = 0, 1, 2


def _run(
    x: torch.Tensor,
    k: int,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: int = _PLAIN,
    residual: torch.Tensor | None = None,
    has_residual: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """The C call: rows made from x by `prologue`, k inputs each, times the packed weight, on
    the engine `policy` picks here."""
    n = packed.shape[0] * 16
    if x.dim() != 2 or k != packed.shape[1] * 32 or x.stride(1) != 1 or x.dtype != torch.bfloat16:
        raise ValueError(
            f"bf16 linear: input {tuple(x.shape)} {x.dtype} does not fit a bf16 weight of "
            f"[{n}, {packed.shape[1] * 32}], or its rows are strided"
        )
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if rows == 0:
        return out
    engine = kernel(policy)
    if engine is None:
        raise RuntimeError("bf16 linear kernel: neither AMX nor AVX512-BF16 runs here")
    b = bias.float().contiguous() if bias is not None else None
    status = cpu_library.library().kvfleet_linear_bf16(
        x.data_ptr(), x.stride(0), prologue,
        residual.data_ptr() if residual is not None else None, int(has_residual),
        norm_weight.data_ptr() if norm_weight is not None else None, eps,
        packed.data_ptr(), b.data_ptr() if b is not None else None,
        out.data_ptr(), out.stride(0), rows, n, k, engine, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"bf16 linear kernel failed with status {status} for x {tuple(x.shape)}")
    return out


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` came from, on the engine `policy`
    picks; x is bf16 [rows, K] with contiguous rows."""
    return _run(x, x.shape[-1], packed, bias, policy=policy)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear(rms_norm(x, norm_weight, eps, residual)[0], packed, bias)` and the residual,
    with the normalised rows written straight into the GEMM's input tiles: the same bits as the
    two calls (`cpu_elementwise.rms_norm`'s arithmetic), one call instead of two. A given
    float32 `residual` is updated in place, as `cpu_elementwise.rms_norm` does."""
    res = residual if residual is not None else torch.empty(x.shape, dtype=torch.float32)
    out = _run(
        x, x.shape[-1], packed, bias, _RMS_NORM, res, residual is not None, norm_weight, eps,
        policy=policy,
    )  # fmt: skip
    return out, res


def silu_and_mul_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`linear(silu_and_mul(x), packed, bias)` for x = [gate | up] rows of 2K values, with the
    gated rows written straight into the GEMM's input tiles: the same bits as the two calls
    (`cpu_elementwise.silu_and_mul`'s arithmetic)."""
    return _run(x, x.shape[-1] // 2, packed, bias, _SILU_AND_MUL, policy=policy)

"""bfloat16 linear layers on CPU with weights prepacked once into oneDNN's blocked layout.

`F.linear` on a plain bf16 weight makes oneDNN reorder the whole weight into its blocked layout
on every call. Our projections have a small inner dimension (576 for the bundled model), so that
reorder costs as much as the multiply: prepacking each weight once at load time made the
bundled model's projection GEMMs 1.3x faster at 32 rows and 2x at 2048 (measured on the 2-core
AVX512-BF16 host, docs/benchmarks.md). Results are the same numbers: both paths run the same
oneDNN bf16 kernel, packing only moves the weight's bytes.

oneDNN builds (JIT-compiles) a kernel per distinct row count, 2-4 ms each here, and keeps 1024
in its cache. A server's steps have ever-changing row counts (decodes plus prompt chunks), so
rows are padded up to a bucket (`padded_rows`: up to 15 rows or 1/16 more, 64 buckets up to 2048
rows) and nearly every step reuses a built kernel.

Row counts up to `cpu_gemm.max_rows(policy)` (the kernel policy's limit for the engine that
runs) go to kvfleet's own bf16 GEMM instead, which is faster than oneDNN there: its AMX engine
(decode batches, and decodes with a prompt of a few hundred tokens beside them: `kvfleet bench
cpu-kernels`, `kvfleet bench gemm-rows`) or, without AMX, its AVX512-BF16 engine (decode
batches); the weight is then held in both layouts (`PackedLinear`), twice its plain size in
memory.

float32 and float16 gained nothing from packing here, so they keep the plain weight and
`F.linear`; so does bf16 on a CPU that only emulates it (`cpu_features.native_bf16`). The
packed ops are the ones PyTorch's own compiler uses for frozen CPU models
(`torch.ops.mkldnn`); where a build lacks them, or `KVFLEET_CPU_KERNELS=0`, weights stay plain.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from kvfleet.kernels.cpu import cpu_features, cpu_gemm
from kvfleet.kernels.cpu.huge_pages import HugePageArena
from kvfleet.kernels.policy import KernelPolicy


@functools.cache
def _packs_bf16() -> bool:
    """oneDNN's packed ops are in this torch build and the CPU runs bf16 natively. Where oneDNN
    only emulates bf16 (AVX-512 without AVX512-BF16 or AMX), the packed GEMM measured 5x slower
    than `F.linear` on a plain weight at one row and sums in another order, so weights stay
    plain there."""
    mkldnn = torch.ops.mkldnn
    return (
        cpu_features.native_bf16()
        and torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


def available() -> bool:
    """Whether bf16 weights can be prepacked on this machine and build."""
    return os.environ.get("KVFLEET_CPU_KERNELS", "1") != "0" and _packs_bf16()


def supports(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: a 2-D bfloat16 CPU tensor, [out_features, in_features]."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not weight.is_mkldnn
    )


@dataclass(slots=True, eq=False)
class PackedLinear:
    """A bf16 [out_features, in_features] weight in the layouts `linear` reads: oneDNN's blocked
    one (an opaque tensor) and, where cpu_gemm runs and takes the shape, AMX tile order (which
    both of its engines read)."""

    onednn: torch.Tensor
    tiles: torch.Tensor | None
    out_features: int
    in_features: int


def pack(weight: torch.Tensor, arena: HugePageArena | None = None) -> PackedLinear:
    """The weight in the layouts `linear` below reads; the tiles that decode steps stream in
    `arena` if given (oneDNN allocates its own layout). Tiles are made wherever cpu_gemm runs,
    whatever a policy later lets it take."""
    plain = weight.detach().contiguous()
    tiles = (
        cpu_gemm.pack(plain, arena) if cpu_gemm.supports(plain) and cpu_gemm.available() else None
    )
    onednn = torch.ops.mkldnn._reorder_linear_weight(plain)
    return PackedLinear(onednn, tiles, plain.shape[0], plain.shape[1])


def padded_rows(rows: int) -> int:
    """`rows` rounded up to its bucket: a multiple of 16, or of 1/32 of the next power of two
    once that is larger (so at most 15 rows or 1/16 more)."""
    step = max(16, (1 << max(rows - 1, 1).bit_length()) // 32)
    return -(-rows // step) * step


def gemm_tiles(weight: object, rows: int, policy: KernelPolicy) -> torch.Tensor | None:
    """The tile-packed weight when a step of `rows` rows through `weight` runs on cpu_gemm under
    `policy` (a `PackedLinear` with tiles, 1 to `cpu_gemm.max_rows(policy)` rows), else None:
    the one place that routes a projection, and the ops fused into it, to that kernel."""
    if isinstance(weight, PackedLinear) and 0 < rows <= cpu_gemm.max_rows(policy):
        return weight.tiles
    return None


def linear(
    x: torch.Tensor,
    packed: PackedLinear,
    bias: torch.Tensor | None = None,
    *,
    policy: KernelPolicy,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` came from, on cpu_gemm where `policy`
    sends this many rows there, else on oneDNN; x is [..., in_features]."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    tiles = gemm_tiles(packed, rows, policy)
    if tiles is not None:
        rows_in = flat if flat.stride(-1) == 1 else flat.contiguous()
        out = cpu_gemm.linear(rows_in, tiles, bias, policy=policy)
        return out.view(*x.shape[:-1], packed.out_features)
    padded = padded_rows(rows)
    if padded != rows:
        # Rows are independent in a GEMM: the padding rows' (uninitialised) values only reach
        # their own output rows, which are dropped.
        buf = torch.empty(padded, flat.shape[1], dtype=flat.dtype)
        buf[:rows] = flat
        flat = buf
    out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed.onednn, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])

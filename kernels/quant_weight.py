"""Quantized projection weights in the one layout every kernel here reads, whatever checkpoint
format they came from (GGUF Q4_0/Q4_1/Q8_0, AWQ, GPTQ, FP8): loaders repack once at start, so
the CPU GEMM (cpu/cpu_gemm_quant.c), the Triton GEMM (triton/triton_quant.py) and the torch
reference (`dequantize`) share one definition of what the bytes mean.

A weight is [out_features, in_features] (N x K, the F.linear convention), cut along K into
groups of `group_size` (a multiple of 32 that divides K), each with a float32 scale and, for
asymmetric formats, a float32 offset, so that every format's dequantization is one expression:

    w[n, k] = scales[n, k // group_size] * q[n, k] (+ offsets[n, k // group_size])

- "int4": q in 0..15, two per byte. qweight is uint8 [N, K / 2]; each run of 16 bytes holds 32
  consecutive weights of a row: byte j's low nibble is weight j of the run, its high nibble
  weight j + 16 (GGUF's own order, so its blocks load without shuffling). AWQ and GPTQ store
  w = s * (q - z): their offset is -s * z, exact in float32 (an fp16 scale times a 4-bit zero).
- "int8": q in -128..127, qweight int8 [N, K]; offsets None (GGUF Q8_0).
- "fp8": qweight float8_e4m3fn [N, K], one group per row (group_size = K, per-channel) or a
  per-tensor scale repeated per row; offsets None.

Scales and offsets are float32 (exact for every format's fp16/bf16/fp32 scales): a Q4_1 block
then streams 24 bytes per 32 weights instead of the file's 20, for kernels with one scale type.

On CPU, int4 and int8 weights are repacked once more at load (`to_blocked`): blocks of `block`
columns (the vector width of the CPU kernel, cpu/cpu_gemm_quant.c, which describes the
byte order), the same bytes reordered so that a vector holds every column of the block; scales
and offsets [blocks, groups * block]. `dequantize` reads both layouts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

FORMATS = ("int4", "int8", "fp8")
# Weights per run of packed int4 bytes (16 bytes), and the granule of every group size.
RUN = 32

_QWEIGHT_DTYPES = {"int4": torch.uint8, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(slots=True, eq=False)
class QuantizedWeight:
    """One projection's quantized weight (see the module docstring for the layout)."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    out_features: int
    in_features: int
    group_size: int
    # 0: the layout above; > 0: the CPU's column-blocked form, `block` columns per block.
    block: int = 0
    # What a kernel derives from the tensors once and keeps (the C kernels' pointer struct).
    native: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.format not in FORMATS:
            raise ValueError(f"format: must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if g < 1 or k % g or (self.format != "fp8" and g % RUN):
            raise ValueError(
                f"group_size: {g} must divide in_features {k}"
                + ("" if self.format == "fp8" else f" and be a multiple of {RUN}")
            )
        packed_k = k // 2 if self.format == "int4" else k
        rows, per_row = n, 1
        if self.block:
            if self.format == "fp8" or self.block < 1:
                raise ValueError(f"block: {self.block} needs an int4 or int8 weight, block >= 1")
            rows, per_row = -(-n // self.block), self.block
        want = {
            "qweight": ((rows, packed_k * per_row), _QWEIGHT_DTYPES[self.format]),
            "scales": ((rows, k // g * per_row), torch.float32),
        }
        if self.offsets is not None:
            want["offsets"] = ((rows, k // g * per_row), torch.float32)
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(
                    f"{name}: expected a contiguous {dtype} tensor of shape {shape}, got "
                    f"{t.dtype} {tuple(t.shape)}"
                )
        if self.offsets is not None and self.format != "int4":
            raise ValueError(f"offsets: only int4 weights have offsets, not {self.format}")

    @property
    def shape(self) -> tuple[int, int]:
        """[out_features, in_features], as a plain weight's."""
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes a GEMM streams through this weight: packed values, scales and offsets."""
        parts = (self.qweight, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on `device`."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(
            self.format, move(self.qweight), move(self.scales), move(self.offsets),
            self.out_features, self.in_features, self.group_size, self.block,
        )  # fmt: skip


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] in the int4 layout -> uint8 [N, K] of values 0..15, in weight order."""
    n, half = qweight.shape
    runs = qweight.view(n, half // 16, 16)
    low, high = runs & 0x0F, runs >> 4
    return torch.cat((low, high), dim=-1).reshape(n, half * 2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8/int [N, K] of values 0..15 in weight order -> uint8 [N, K / 2] in the int4 layout
    (the inverse of `unpack_int4`); K must be a multiple of 32."""
    n, k = q.shape
    if k % RUN:
        raise ValueError(f"in_features: {k} is not a multiple of {RUN}")
    runs = q.to(torch.uint8).view(n, k // RUN, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The plain [N, K] weight `weight` stands for, computed in float32 and returned in `dtype`:
    the specification every quantized kernel is tested against."""
    if weight.block:
        weight = to_rows(weight)
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    if weight.format == "int4":
        q = unpack_int4(weight.qweight).float()
    else:
        q = weight.qweight.float()
    w = q.view(n, k // g, g) * weight.scales.unsqueeze(-1)
    if weight.offsets is not None:
        w = w + weight.offsets.unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def concat_out(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one input stacked along out_features (q/k/v, gate/up fused into one GEMM); all
    must share format, in_features, group size and whether they have offsets."""
    first = weights[0]
    for w in weights[1:]:
        same = (w.format, w.in_features, w.group_size, w.offsets is None)
        if same != (first.format, first.in_features, first.group_size, first.offsets is None):
            raise ValueError(
                f"cannot fuse quantized weights of different layouts: {first.format}/"
                f"group {first.group_size} and {w.format}/group {w.group_size}"
            )
    offsets = None if first.offsets is None else torch.cat([w.offsets for w in weights])
    return QuantizedWeight(
        first.format,
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
        offsets,
        sum(w.out_features for w in weights),
        first.in_features,
        first.group_size,
    )


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False) -> QuantizedWeight:
    """Round-to-nearest int4 of a float [N, K] weight (min/max per group; symmetric: zero 8),
    for tests and `random:` models; real checkpoints come quantized. Scales are rounded to
    fp16, as AWQ's and GPTQ's are, so that scale * q + offset is exact in float32 and every
    kernel's order of those two operations gives the same weight."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7.0).clamp_min(1e-4)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15.0).clamp_min(1e-4)
        zero = (-lo / scale).round().clamp(0, 15)
    scale = scale.half().float()
    q = (groups / scale.unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15)
    return QuantizedWeight(
        "int4",
        pack_int4(q.reshape(n, k)),
        scale.contiguous(),
        (-scale * zero).contiguous(),
        n,
        k,
        group_size,
    )


@functools.cache
def _block_order(fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte of a blocked run (int4: 16 x block, int8: 32 x block bytes), the column
    within its block and the byte within that column's run in the row layout."""
    o = torch.arange((16 if fmt == "int4" else 32) * block)
    if fmt == "int4":
        load, rem = o // (4 * block), o % (4 * block)
        lane, t = rem // 16, rem % 16
        col = 4 * lane + t % 8 // 2
        return col, 4 * load + 2 * (t // 8) + t % 2
    rem = o % (2 * block)
    return rem // 2, 2 * (o // (2 * block)) + rem % 2


def _group_major(t: torch.Tensor, blocks: int, block: int) -> torch.Tensor:
    """Per-column group values [N, groups] -> [blocks, groups * block], zero-padded."""
    padded = torch.zeros(blocks * block, t.shape[1], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.view(blocks, block, -1).transpose(1, 2).reshape(blocks, -1).contiguous()


def to_blocked(weight: QuantizedWeight, block: int) -> QuantizedWeight:
    """`weight` (int4 or int8, row layout) in the CPU's column-blocked layout of `block` columns."""
    if weight.block or weight.format not in ("int4", "int8"):
        raise ValueError(f"to_blocked: needs an int4 or int8 weight in the row layout, not "
                         f"{weight.format} with block {weight.block}")  # fmt: skip
    n, k = weight.out_features, weight.in_features
    blocks, run_bytes = -(-n // block), 16 if weight.format == "int4" else 32
    q = torch.zeros(blocks * block, weight.qweight.shape[1], dtype=weight.qweight.dtype)
    q[:n] = weight.qweight
    col, byte = _block_order(weight.format, block)
    rows = q.view(blocks, block, k // RUN, run_bytes)[:, col, :, byte]  # [run bytes, blocks, runs]
    offsets = weight.offsets
    return QuantizedWeight(
        weight.format, rows.permute(1, 2, 0).reshape(blocks, -1).contiguous(),
        _group_major(weight.scales, blocks, block),
        None if offsets is None else _group_major(offsets, blocks, block),
        n, k, weight.group_size, block,
    )  # fmt: skip


def to_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """A blocked weight back in the row layout (the inverse of `to_blocked`)."""
    n, k, block = weight.out_features, weight.in_features, weight.block
    blocks, run_bytes = weight.qweight.shape[0], 16 if weight.format == "int4" else 32
    col, byte = _block_order(weight.format, block)
    q = torch.empty(blocks, block, k // RUN, run_bytes, dtype=weight.qweight.dtype)
    q[:, col, :, byte] = weight.qweight.view(blocks, k // RUN, -1).permute(2, 0, 1)

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.view(blocks, -1, block).transpose(1, 2).reshape(blocks * block, -1)[:n]

    return QuantizedWeight(
        weight.format, q.reshape(blocks * block, -1)[:n].contiguous(),
        per_column(weight.scales).contiguous(),
        None if weight.offsets is None else per_column(weight.offsets).contiguous(),
        n, k, weight.group_size,
    )  # fmt: skip

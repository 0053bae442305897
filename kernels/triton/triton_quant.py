"""Triton GEMM through quantized weights (kernels/quant_weight.py's layout): w4a16, w8a16 and
fp8 weight-only projections. The weight is streamed as stored and dequantized in registers, never
materialised as a float matrix, so a decode step reads 0.5 or 1 byte a weight instead of 2.

One kernel, the format a constexpr. A program computes a BLOCK_M x BLOCK_N tile of the output
over one slice of K, in tiles of BLOCK_K:

- The quantized values go into the MMA as they are, converted to x's dtype (0..15, -128..127 and
  every e4m3 value are exact in fp32, bf16 and fp16), and the scale multiplies the tile's float32
  partial product afterwards. BLOCK_K divides the group size, so a tile has one scale (and
  offset) per output column: sum_k x_k (s q_k + o) = s * sum_k x_k q_k + o * sum_k x_k. That is
  one multiply per output element a tile instead of one per weight, and no rounding of s * q to
  16 bits: the result is the float32 product with `dequantize(weight)`, up to summation order.
  Weights with one group a row (fp8's per-channel scales) are scaled once, after the loop.
- int4: a tile's BLOCK_K / 2 bytes are whole 32-weight runs, low nibbles weights 0..15 of their
  run and high nibbles 16..31. Rather than interleave the nibbles into weight order in registers,
  x is loaded in theirs: the columns of the low nibbles, those of the high ones, and two dots.
- Decode steps (a few rows) give few output tiles, so K is split across programs until about
  two per SM run. Their float32 partial sums go to a [SPLIT_K, M, N] buffer that a second kernel
  adds in a fixed order (atomics would not: a CUDA-graph replay must give the eager step's
  numbers), adding the bias and rounding once to x's dtype.

Every tensor is addressed through its strides, so x may be a column slice of a wider activation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from kvfleet.kernels.quant_weight import RUN, QuantizedWeight
from kvfleet.kernels.triton.triton_dot import dot_precision, mma, upcast_dot

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The `FORMAT` argument: how a tile of stored values becomes q.
INT4 = tl.constexpr(0)
INT8 = tl.constexpr(1)
FP8 = tl.constexpr(2)
_FORMAT_CODES = {"int4": INT4.value, "int8": INT8.value, "fp8": FP8.value}
# A run of packed int4 bytes: its weights and bytes, as constexprs the kernel may read.
_RUN = tl.constexpr(RUN)
_RUN_BYTES = tl.constexpr(RUN // 2)

# Tile shapes by rows a step, (max rows, BLOCK_M, BLOCK_N, largest BLOCK_K, warps, stages):
# decode at the MMA's minimum of 16 rows with narrow N tiles (more programs before K is split);
# prefill at 128 x 128, the dequantized weight tile shared by 128 rows. Starting points taken
# from common Triton w4a16 tilings, not yet measured on a GPU here.
_TILINGS = (
    (16, 16, 64, 128, 4, 4),
    (32, 32, 64, 128, 4, 4),
    (64, 64, 64, 128, 4, 3),
    (None, 128, 128, 64, 8, 3),
)
# The smallest K a tl.dot takes (an int4 tile must also hold whole runs of RUN weights).
_MIN_DOT_K = 16
# Output tiles grouped GROUP_M rows of tiles at a time: consecutive programs share weight
# tiles in L2 while a prefill's M tiles walk along N.
_GROUP_M = 8
# Split K until about this many programs per SM run, in at most this many splits.
_PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 16
# Under the interpreter there is no GPU to fill: a small count keeps the split path reachable
# at test sizes without making every test split.
_FALLBACK_SMS = 2
# Columns per program of the kernel adding the splits.
_REDUCE_BLOCK_N = 256


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    offsets_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    tiles_per_split,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_b,
    stride_os,
    stride_om,
    stride_on,
    FORMAT: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PER_ROW: tl.constexpr,  # one group a row: scaled after the loop, not per tile
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no tile needs a mask along K
    PARTIAL: tl.constexpr,  # K is split: store float32 partial sums, the reduce kernel ends
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the ends read row M - 1's and column N - 1's operands again (wrapped
    # indices, no masks in the loop); their results are never stored.
    x_rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm
    cols = (offs_n % N).to(tl.int64)
    q_cols = q_ptr + cols[None, :] * stride_qn

    k_first = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_first + tiles_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_k x_k, for the offsets' term
    for k0 in range(k_first, k_end, BLOCK_K):
        if FORMAT == INT4:
            offs_b = tl.arange(0, BLOCK_K // 2)
            # Byte b of the tile: low nibble weight (b // 16) * 32 + b % 16, high that + 16.
            k_lo = k0 + (offs_b // _RUN_BYTES) * _RUN + offs_b % _RUN_BYTES
            packed = _load_k(q_cols + (k0 // 2 + offs_b)[:, None] * stride_qk, k_lo, K, EVEN_K, 0)
            x_lo = _load_k(x_rows + k_lo[None, :] * stride_xk, k_lo, K, EVEN_K, 1)
            k_hi = k_lo + _RUN_BYTES
            x_hi = _load_k(x_rows + k_hi[None, :] * stride_xk, k_hi, K, EVEN_K, 1)
            part = mma(x_lo, _dot_operand(packed & 0xF, x_lo, UPCAST), UPCAST, PRECISION)
            part += mma(x_hi, _dot_operand(packed >> 4, x_hi, UPCAST), UPCAST, PRECISION)
            if HAS_OFFSETS:
                tile_sum = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            q = _load_k(q_cols + offs_k[:, None] * stride_qk, offs_k, K, EVEN_K, 0)
            x = _load_k(x_rows + offs_k[None, :] * stride_xk, offs_k, K, EVEN_K, 1)
            part = mma(x, _dot_operand(q, x, UPCAST), UPCAST, PRECISION)
        if PER_ROW:
            acc += part
            if HAS_OFFSETS:
                x_sum += tile_sum
        else:
            group = k0 // group_size
            scale = tl.load(scales_ptr + cols * stride_sn + group * stride_sg)
            acc += part * scale[None, :]
            if HAS_OFFSETS:
                offset = tl.load(offsets_ptr + cols * stride_zn + group * stride_zg)
                acc += tile_sum[:, None] * offset[None, :]
    if PER_ROW:
        acc *= tl.load(scales_ptr + cols * stride_sn)[None, :]
        if HAS_OFFSETS:
            acc += x_sum[:, None] * tl.load(offsets_ptr + cols * stride_zn)[None, :]

    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    if PARTIAL:
        tl.store(out + pid_k * stride_os, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols * stride_b).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _load_k(ptrs, offs_k, K, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """The tile at `ptrs`, whose index along axis K_AXIS is `offs_k`: zeros past K, so that a
    partial last tile adds nothing (no mask at all where K is a multiple of BLOCK_K)."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        if K_AXIS == 0:
            mask = (offs_k < K)[:, None]
        else:
            mask = (offs_k < K)[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _dot_operand(q, x, UPCAST: tl.constexpr):
    """Stored values as the dot's other operand: x's dtype (exact for every format), float32
    where the interpreter widens dots (its integer -> bfloat16 casts give wrong values)."""
    if UPCAST:
        return q.to(tl.float32)
    else:
        return q.to(x.dtype)


@triton.jit
def _reduce_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_ps,
    stride_pm,
    stride_pn,
    stride_b,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    parts = part_ptr + row * stride_pm + offs_n * stride_pn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # split 0 first, always: the same sum every call
        acc += tl.load(parts + s * stride_ps, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_b, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_om + offs_n * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=n_mask,
    )


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One call's tiles, K split and launch options (`choose_config`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    tiles_per_split: int
    per_row: bool
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    # Cached: a step runs this once per projection, and the property query is not free.
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_SMS


def _block_k(weight: QuantizedWeight, largest: int) -> tuple[int, bool]:
    """BLOCK_K and whether the weight is scaled per row: a tile must lie in one group, so
    BLOCK_K is the largest power of two up to `largest` dividing the group size, unless the
    group is the whole row (then any BLOCK_K, K's tail masked)."""
    k, g = weight.in_features, weight.group_size
    least = RUN if weight.format == "int4" else _MIN_DOT_K
    if g == k:
        return max(least, min(largest, triton.next_power_of_2(k))), True
    block_k = min(largest, g & -g)
    if block_k < least:
        raise ValueError(
            f"triton_quant.linear: group_size {g} of a {weight.format} weight is not a "
            f"multiple of {least}, the smallest K tile the kernel takes"
        )
    return block_k, False


def choose_config(
    rows: int, weight: QuantizedWeight, num_sms: int, split_k: int | None = None
) -> LaunchConfig:
    """Tiles for `rows` rows through `weight` (`_TILINGS`), and K split so that about
    _PROGRAMS_PER_SM programs per SM run when the output has fewer tiles than that; `split_k`
    overrides the split (rounded so that no split is empty)."""
    tiling = next(t for t in _TILINGS if t[0] is None or rows <= t[0])
    _, block_m, block_n, largest_k, warps, stages = tiling
    block_k, per_row = _block_k(weight, largest_k)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(weight.out_features, block_n)
    k_tiles = triton.cdiv(weight.in_features, block_k)
    if split_k is None:
        split_k = min(math.ceil(_PROGRAMS_PER_SM * num_sms / tiles), MAX_SPLIT_K)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    return LaunchConfig(
        block_m, block_n, block_k, split_k, tiles_per_split, per_row, warps, stages
    )  # fmt: skip


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(
            f"triton_quant.linear: weight must be a QuantizedWeight, not {type(weight)}"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"triton_quant.linear: x dtype {x.dtype} is not float32, bf16 or fp16")
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"triton_quant.linear: x of shape {tuple(x.shape)} does not end in the weight's "
            f"in_features {weight.in_features}"
        )
    if x.device != weight.device:
        raise ValueError(f"triton_quant.linear: x is on {x.device}, the weight on {weight.device}")
    if bias is not None and (
        tuple(bias.shape) != (weight.out_features,)
        or bias.dtype not in _FLOAT_DTYPES
        or bias.device != x.device
    ):
        raise ValueError(
            f"triton_quant.linear: bias must be a float [{weight.out_features}] tensor on "
            f"{x.device}, got {bias.dtype} {tuple(bias.shape)} on {bias.device}"
        )


def linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """x @ dequantize(weight).T + bias for x [..., in_features] in float32, bfloat16 or float16,
    returned in x's dtype, accumulated in float32 and rounded once.

    weight: int4 (with or without offsets) or int8 with groups of multiples of 32, or fp8 with
    one group a row (or groups of multiples of 16). bias: [out_features], any float dtype.
    `split_k` overrides how many programs share K (tests use it to reach both paths)."""
    _check(x, weight, bias)
    n, k = weight.out_features, weight.in_features
    rows_x = x.reshape(-1, k)  # a view for 2-D column slices; strides are passed, not assumed
    m = rows_x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = choose_config(m, weight, _num_sms(x.device), split_k)
    partial = cfg.split_k > 1
    target = out
    if partial:
        target = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    offsets = weight.offsets
    has_offsets = offsets is not None
    z = offsets if has_offsets else weight.scales  # a valid pointer the kernel never reads
    grid = (
        triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),
        cfg.split_k,
    )
    _quant_gemm_kernel[grid](
        rows_x, weight.qweight, weight.scales, z, bias if bias is not None else out, target,
        m, n, k, weight.group_size, cfg.tiles_per_split,
        rows_x.stride(0), rows_x.stride(1),
        weight.qweight.stride(0), weight.qweight.stride(1),
        weight.scales.stride(0), weight.scales.stride(1),
        z.stride(0), z.stride(1),
        bias.stride(0) if bias is not None else 0,
        target.stride(0) if partial else 0,
        target.stride(-2), target.stride(-1),
        FORMAT=_FORMAT_CODES[weight.format],
        HAS_OFFSETS=has_offsets,
        HAS_BIAS=bias is not None,
        PER_ROW=cfg.per_row,
        EVEN_K=k % cfg.block_k == 0,
        PARTIAL=partial,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=_GROUP_M,
        PRECISION=dot_precision(x.dtype),
        UPCAST=upcast_dot(x.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if partial:
        block_n = min(_REDUCE_BLOCK_N, triton.next_power_of_2(n))
        _reduce_splits_kernel[(m, triton.cdiv(n, block_n))](
            target, bias if bias is not None else out, out, n,
            target.stride(0), target.stride(1), target.stride(2),
            bias.stride(0) if bias is not None else 0,
            out.stride(0), out.stride(1),
            SPLIT_K=cfg.split_k,
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)

"""`kvfleet bench kernels`: the attention kernels against the GPU's own roofline.

Decode attention is memory-bound, so it is reported as GB/s against the device-to-device copy
bandwidth measured in the same run; prefill attention is compute-bound, so TFLOP/s against the
measured bf16 matmul rate. torch SDPA on contiguous (un-paged) tensors runs the same shapes as
a reference point. Needs CUDA; torch and triton are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
PREFILL_SHAPES = ((1, 512), (1, 2048), (4, 2048), (1, 8192))  # (sequences, tokens each)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BF16_BYTES = 2
# Rotate through enough input sets that each timed call reads from HBM, not from L2 (50 MB).
ROTATE_MIN_BYTES = 256 * 2**20
MAX_ROTATIONS = 4


@dataclass(slots=True)
class DecodeResult:
    """One decode-attention shape: Triton kernel and SDPA timings with their bandwidth."""

    batch: int
    context: int
    time_us: float
    bytes_moved: int
    gbps: float
    fraction_of_copy: float
    sdpa_time_us: float
    sdpa_gbps: float


@dataclass(slots=True)
class PrefillResult:
    """One prefill-attention shape: Triton kernel and SDPA timings with their compute rate."""

    sequences: int
    tokens: int
    time_us: float
    flops: float
    tflops: float
    fraction_of_matmul: float
    sdpa_time_us: float
    sdpa_tflops: float


def decode_attention_bytes(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
) -> int:
    """Bytes one decode step must move: every cached K and V element once, the query and output
    once each, and the block-table entries plus sequence lengths (int32)."""
    kv = 2 * batch * context * num_kv_heads * head_dim * dtype_bytes
    q_and_out = 2 * batch * num_heads * head_dim * dtype_bytes
    tables = batch * (-(-context // block_size) + 1) * 4
    return kv + q_and_out + tables


def prefill_attention_flops(sequences: int, tokens: int, num_heads: int, head_dim: int) -> float:
    """Causal prefill FLOPs with nothing cached: query i sees i + 1 keys; QK^T and PV each cost
    2 FLOPs per multiply-add over head_dim."""
    visible_pairs = tokens * (tokens + 1) // 2
    return 4.0 * sequences * num_heads * head_dim * visible_pairs


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `kernels` under `kvfleet bench`."""
    p = subparsers.add_parser(
        "kernels",
        help="time the Triton attention kernels against measured copy bandwidth and matmul rate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per shape (default 5)")
    p.add_argument("--iters", type=int, default=30, help="timed calls per shape (default 30)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit code 2 with a message when no CUDA device is present."""
    if args.warmup < 0 or args.iters < 1:
        print("kvfleet bench kernels: --warmup must be >= 0 and --iters >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "kvfleet bench kernels: needs a CUDA GPU (torch.cuda.is_available() is False). "
            "Kernel correctness on CPU: TRITON_INTERPRET=1 pytest tests/kernels",
            file=sys.stderr,
        )
        return 2
    report = _measure(torch, args.warmup, args.iters)
    _print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _median_us(torch, calls: list[Callable[[], object]], warmup: int, iters: int) -> float:
    """Median CUDA-event time of one call, cycling through `calls` (one per input set)."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def _rotations(set_bytes: int) -> int:
    return max(1, min(MAX_ROTATIONS, -(-ROTATE_MIN_BYTES // max(set_bytes, 1))))


def _measure(torch, warmup: int, iters: int) -> dict:
    from kvfleet.kernels.triton_decode import decode_attention
    from kvfleet.kernels.triton_prefill import prefill_attention

    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    scale = HEAD_DIM**-0.5

    src = torch.empty(2**30 // 2, dtype=bf16, device=dev)
    dst = torch.empty_like(src)
    copy_us = _median_us(torch, [partial(dst.copy_, src)], warmup, iters)
    copy_gbps = 2 * src.numel() * 2 / (copy_us * 1e3)
    del src, dst

    n = 8192
    a = torch.randn(n, n, dtype=bf16, device=dev)
    b = torch.randn(n, n, dtype=bf16, device=dev)
    mm_us = _median_us(torch, [partial(torch.matmul, a, b)], warmup, iters)
    matmul_tflops = 2 * n**3 / (mm_us * 1e6)
    del a, b

    decode = []
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            nbytes = decode_attention_bytes(
                batch, context, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BF16_BYTES, BLOCK_SIZE
            )
            blocks_per_seq = context // BLOCK_SIZE
            num_blocks = batch * blocks_per_seq
            calls, sdpa_calls = [], []
            for _ in range(_rotations(nbytes)):
                shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
                kc = torch.randn(shape, dtype=bf16, device=dev)
                vc = torch.randn(shape, dtype=bf16, device=dev)
                tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32)
                tables = tables.view(batch, blocks_per_seq)
                lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
                q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=bf16, device=dev)
                calls.append(partial(decode_attention, q, kc, vc, tables, lens, context, scale))
                # SDPA reads the same values laid out contiguously: [batch, kv_heads, ctx, D].
                k = kc.view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                v = vc.view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
                qs = q.unsqueeze(2)
                sdpa_calls.append(partial(sdpa, qs, k, v, scale=scale, enable_gqa=True))
            t_us = _median_us(torch, calls, warmup, iters)
            s_us = _median_us(torch, sdpa_calls, warmup, iters)
            gbps = nbytes / (t_us * 1e3)
            decode.append(
                DecodeResult(
                    batch,
                    context,
                    t_us,
                    nbytes,
                    gbps,
                    gbps / copy_gbps,
                    s_us,
                    nbytes / (s_us * 1e3),
                )
            )
            del calls, sdpa_calls
            torch.cuda.empty_cache()

    prefill = []
    for seqs, tokens in PREFILL_SHAPES:
        flops = prefill_attention_flops(seqs, tokens, NUM_HEADS, HEAD_DIM)
        blocks_per_seq = tokens // BLOCK_SIZE
        shape = (seqs * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kc = torch.randn(shape, dtype=bf16, device=dev)
        vc = torch.randn(shape, dtype=bf16, device=dev)
        tables = torch.randperm(shape[0], device=dev, dtype=torch.int32).view(seqs, blocks_per_seq)
        lens = torch.full((seqs,), tokens, dtype=torch.int32, device=dev)
        starts = torch.arange(0, (seqs + 1) * tokens, tokens, dtype=torch.int32, device=dev)
        q = torch.randn(seqs * tokens, NUM_HEADS, HEAD_DIM, dtype=bf16, device=dev)
        t_us = _median_us(
            torch,
            [partial(prefill_attention, q, kc, vc, tables, lens, starts, tokens, scale)],
            warmup,
            iters,
        )
        qs = q.view(seqs, tokens, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        k = kc.view(seqs, tokens, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        v = vc.view(seqs, tokens, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        s_us = _median_us(
            torch,
            [partial(sdpa, qs, k, v, is_causal=True, scale=scale, enable_gqa=True)],
            warmup,
            iters,
        )
        tflops = flops / (t_us * 1e6)
        prefill.append(
            PrefillResult(
                seqs,
                tokens,
                t_us,
                flops,
                tflops,
                tflops / matmul_tflops,
                s_us,
                flops / (s_us * 1e6),
            )
        )

    return {
        "device": torch.cuda.get_device_name(dev),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
        },
        "copy_gbps": copy_gbps,
        "matmul_tflops": matmul_tflops,
        "decode": [asdict(r) for r in decode],
        "prefill": [asdict(r) for r in prefill],
    }


def _print_report(report: dict) -> None:
    print(f"device: {report['device']}")
    print(
        f"d2d copy: {report['copy_gbps']:.0f} GB/s   bf16 matmul: {report['matmul_tflops']:.0f} TFLOP/s"
    )
    print("decode attention (32 q / 8 kv heads, D=128, bf16)")
    print(
        f"{'batch':>6} {'ctx':>6} {'us':>9} {'GB/s':>7} {'of copy':>8} {'sdpa us':>9} {'sdpa GB/s':>9}"
    )
    for r in report["decode"]:
        print(
            f"{r['batch']:>6} {r['context']:>6} {r['time_us']:>9.1f} {r['gbps']:>7.0f} "
            f"{r['fraction_of_copy']:>8.0%} {r['sdpa_time_us']:>9.1f} {r['sdpa_gbps']:>9.0f}"
        )
    print("prefill attention (causal, nothing cached)")
    print(
        f"{'seqs':>6} {'tokens':>6} {'us':>9} {'TFLOP/s':>8} {'of mm':>6} {'sdpa us':>9} {'sdpa TF/s':>9}"
    )
    for r in report["prefill"]:
        print(
            f"{r['sequences']:>6} {r['tokens']:>6} {r['time_us']:>9.1f} {r['tflops']:>8.1f} "
            f"{r['fraction_of_matmul']:>6.0%} {r['sdpa_time_us']:>9.1f} {r['sdpa_tflops']:>9.1f}"
        )

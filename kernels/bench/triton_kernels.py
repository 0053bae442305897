"""`kvfleet bench kernels`: the attention kernels against the GPU's own roofline.

Decode attention is memory-bound, so it is reported as GB/s against the device-to-device copy
bandwidth measured in the same run; prefill attention is compute-bound, so TFLOP/s against the
measured bf16 matmul rate. torch SDPA on contiguous (un-paged) tensors runs the same shapes as
a reference point, and every kernel's output is checked against it before it is timed (exit
code 1 on a mismatch). Needs CUDA; torch and triton are imported only when the command runs.
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
# GPU clock cycles (~0.5 ms on an H100/H200) that cover the host launching one timed call.
LAUNCH_COVER_CYCLES = 1_000_000


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
    try:
        report = _measure(torch, args.warmup, args.iters)
    except KernelMismatch as exc:
        print(f"kvfleet bench kernels: {exc}", file=sys.stderr)
        return 1
    _print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _median_us(torch, calls: list[Callable[[], object]], warmup: int, iters: int) -> float:
    """Median CUDA-event time of one call, cycling through `calls` (one per input set).

    Each call is queued behind a short GPU sleep, so that the time between the events is the
    GPU's work alone and not the host's launch latency: the engine replays decode from CUDA
    graphs, where no launch is paid per kernel. Without it, the host's speed (which differs
    from one lent machine to the next) set a floor of 80-130 µs under every small shape."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def _rotations(set_bytes: int) -> int:
    return max(1, min(MAX_ROTATIONS, -(-ROTATE_MIN_BYTES // max(set_bytes, 1))))


class KernelMismatch(AssertionError):
    """A kernel's output disagrees with SDPA on the same inputs: its timing would mean nothing."""


# bf16 inputs, float32 accumulation in both: differences are bf16 rounding of the outputs.
VERIFY_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


@dataclass(slots=True)
class AttentionCase:
    """One input set of a shape: the Triton kernel call and SDPA on the same values laid out
    contiguously, each returning its output in the layout `verify` compares."""

    kernel: Callable[[], object]
    sdpa: Callable[[], object]


def _paged_kv(torch, seqs: int, tokens: int, kv_heads: int, head_dim: int, block_size: int,
              device) -> tuple:  # fmt: skip
    """Random bf16 K/V caches of `seqs` sequences of `tokens` each behind a shuffled block
    table, and the same values gathered contiguously as SDPA reads them ([seqs, kv_heads,
    tokens, D])."""
    blocks_per_seq = -(-tokens // block_size)
    num_blocks = seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    vc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(seqs, blocks_per_seq)

    def gathered(cache):
        rows = cache[tables.long().reshape(-1)].view(seqs, -1, kv_heads, head_dim)
        return rows[:, :tokens].transpose(1, 2).contiguous()

    lens = torch.full((seqs,), tokens, dtype=torch.int32, device=device)
    return kc, vc, tables, lens, gathered(kc), gathered(vc)


def decode_case(torch, batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, device) -> AttentionCase:  # fmt: skip
    """Random paged inputs (a shuffled block table) for decode attention on `device`."""
    from kvfleet.kernels.triton.triton_decode import decode_attention

    scale = head_dim**-0.5
    kc, vc, tables, lens, k, v = _paged_kv(torch, batch, context, kv_heads, head_dim,
                                           block_size, device)  # fmt: skip
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return AttentionCase(
        kernel=partial(decode_attention, q, kc, vc, tables, lens, context, scale),
        sdpa=lambda: sdpa(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2),
    )


def prefill_case(torch, sequences: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, device) -> AttentionCase:  # fmt: skip
    """Random paged inputs for causal prefill attention with nothing cached, on `device`."""
    from kvfleet.kernels.triton.triton_prefill import prefill_attention

    scale = head_dim**-0.5
    kc, vc, tables, lens, k, v = _paged_kv(torch, sequences, tokens, kv_heads, head_dim,
                                           block_size, device)  # fmt: skip
    starts = torch.arange(0, (sequences + 1) * tokens, tokens, dtype=torch.int32, device=device)
    q = torch.randn(sequences * tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
    qs = q.view(sequences, tokens, heads, head_dim).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def reference():
        out = sdpa(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(sequences * tokens, heads, head_dim)

    return AttentionCase(
        kernel=partial(prefill_attention, q, kc, vc, tables, lens, starts, tokens, scale),
        sdpa=reference,
    )


def verify(torch, name: str, case: AttentionCase, kernel_out=None) -> None:
    """Raise KernelMismatch unless the kernel's output (computed now, or `kernel_out`) matches
    SDPA's on the same inputs."""
    got = case.kernel() if kernel_out is None else kernel_out
    want = case.sdpa()
    try:
        torch.testing.assert_close(got.float(), want.float(), **VERIFY_TOLERANCE)
    except AssertionError as exc:
        raise KernelMismatch(f"{name}: the Triton kernel disagrees with SDPA\n{exc}") from None


def _measure(torch, warmup: int, iters: int) -> dict:
    dev = torch.device("cuda")
    bf16 = torch.bfloat16

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
            shape = (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dev)
            cases = [decode_case(torch, batch, context, *shape) for _ in range(_rotations(nbytes))]
            verify(torch, f"decode attention, batch {batch} x context {context}", cases[0])
            t_us = _median_us(torch, [c.kernel for c in cases], warmup, iters)
            s_us = _median_us(torch, [c.sdpa for c in cases], warmup, iters)
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
            del cases
            torch.cuda.empty_cache()

    prefill = []
    for seqs, tokens in PREFILL_SHAPES:
        flops = prefill_attention_flops(seqs, tokens, NUM_HEADS, HEAD_DIM)
        case = prefill_case(torch, seqs, tokens, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dev)
        verify(torch, f"prefill attention, {seqs} x {tokens} tokens", case)
        t_us = _median_us(torch, [case.kernel], warmup, iters)
        s_us = _median_us(torch, [case.sdpa], warmup, iters)
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
        del case
        torch.cuda.empty_cache()

    return {
        "device": torch.cuda.get_device_name(dev),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
        },
        "verified_against_sdpa": True,  # every shape, before timing (else KernelMismatch)
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

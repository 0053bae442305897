"""`kvfleet bench cpu-kernels`' report: one row type per section (prefill and decode attention,
projections, the float32 kernels), each row a kernel against the path it replaces on one shape,
and the table printed from the JSON document those rows make."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefillRow:
    query_tokens: int
    context_tokens: int
    reference_ms: float
    kernel: str | None  # which bf16 prefill kernel ran (cpu_prefill.bf16_kernel), None: none
    kernel_ms: float | None
    kernel_speedup: float | None
    kernel_tflops: float | None


@dataclass(slots=True)
class DecodeRow:
    block_order: str  # "shuffled" or "consecutive" physical blocks within each sequence
    sequences: int
    context_tokens: int  # summed over the sequences
    reference_ms: float
    dot_ms: float | None
    amx_ms: float | None
    dot_gbps: float | None
    amx_gbps: float | None
    amx_speedup_over_dot: float | None


@dataclass(slots=True)
class GemmRow:
    rows: int
    weight_mb: float  # read per step: every layer's projections and the LM head
    onednn_ms: float
    kernel: str | None  # cpu_gemm's engine ("AMX", "AVX512-BF16"), None where neither runs
    kernel_ms: float | None
    onednn_gbps: float
    kernel_gbps: float | None
    kernel_speedup: float | None
    # The 30 layers as the model runs them on cpu_gemm (norms and gate included), with the norm
    # and gate as separate calls, then fused into the GEMMs' input rows.
    separate_ops_ms: float | None = None
    fused_ops_ms: float | None = None
    # cpu_gemm's step with the same tiles on 2 MiB pages (as the engine holds them), in turns
    # with kernel_ms's 4 KiB pages; up to HUGE_PAGE_MAX_ROWS rows, where the kernel runs and
    # the kernel gives them.
    kernel_huge_pages_ms: float | None = None
    kernel_huge_pages_gbps: float | None = None


@dataclass(slots=True)
class Float32Row:
    """A float32 kernel against the torch path it replaces, on one shape."""

    shape: str  # e.g. "q=272 ctx=272" or "rows=32"
    torch_ms: float
    kernel_ms: float
    speedup: float
    kernel_tflops: float | None  # where the work is matmul FLOPs
    kernel_gbps: float | None = None  # where the work is reading memory (decode attention)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_report(report: dict) -> None:
    """The report as tables, one per section (float32 sections only where they ran)."""
    print(f"device: {report['device']}, {report['threads']} threads, AMX {report['amx']}")
    print(f"memory read (float32 sum): {report['read_gbps']:.1f} GB/s")
    print("prefill attention (9 q / 3 kv heads, D=64, bf16), ms per layer")
    kernel = report["bf16_prefill_kernel"] or "kernel"
    print(f"{'q':>6} {'ctx':>6} {'torch':>8} {kernel:>8} {'speedup':>8} {'TFLOP/s':>8}")
    for r in report["prefill"]:
        print(
            f"{r['query_tokens']:>6} {r['context_tokens']:>6} {r['reference_ms']:>8.2f} "
            f"{_fmt(r['kernel_ms'], '8.2f')} {_fmt(r['kernel_speedup'], '7.2f')}x "
            f"{_fmt(r['kernel_tflops'], '8.2f')}"
        )
    print("decode attention, ms per layer (GB/s of K/V read)")
    for r in report["decode"]:
        print(
            f"{r['sequences']} sequences, {r['context_tokens']} context tokens, "
            f"{r['block_order']} blocks: "
            f"torch {r['reference_ms']:.2f}, dot {_fmt(r['dot_ms'], '.2f')} "
            f"({_fmt(r['dot_gbps'], '.1f')}), AMX {_fmt(r['amx_ms'], '.2f')} "
            f"({_fmt(r['amx_gbps'], '.1f')}), AMX over dot "
            f"{_fmt(r['amx_speedup_over_dot'], '.2f')}x"
        )
    if report["projections"]:
        name = report["projections"][0]["kernel"] or "cpu_gemm"
        print("projections per step (30 layers + LM head), ms (GB/s of weights read); then the")
        print(
            f"30 layers' projections with their norms and gate, separate calls and fused ({name})"
        )
        print(f"and {name} with the tiles on 2 MiB pages (decode sizes)")
        print(
            f"{'rows':>6} {'oneDNN':>15} {name:>15} {'speedup':>8} {'separate':>9} {'fused':>7} "
            f"{'2 MiB pages':>15}"
        )
        for r in report["projections"]:
            print(
                f"{r['rows']:>6} {r['onednn_ms']:>7.2f} ({r['onednn_gbps']:>4.1f}) "
                f"{_fmt(r['kernel_ms'], '7.2f')} ({_fmt(r['kernel_gbps'], '4.1f')}) "
                f"{_fmt(r['kernel_speedup'], '7.2f')}x {_fmt(r['separate_ops_ms'], '9.2f')} "
                f"{_fmt(r['fused_ops_ms'], '7.2f')} {_fmt(r['kernel_huge_pages_ms'], '7.2f')} "
                f"({_fmt(r['kernel_huge_pages_gbps'], '4.1f')})"
            )
    if report.get("quantized"):
        print("int4 projections per step (30 layers, int8 LM head), ms: dequantized per call into")
        print("the float32 GEMM vs cpu_gemm_quant (GB/s of packed weights read)")
        for r in report["quantized"]:
            print(
                f"  {r['shape']:>20} {r['torch_ms']:>9.2f} {r['kernel_ms']:>9.2f} "
                f"{r['speedup']:>6.2f}x  {_fmt(r['kernel_gbps'], '.1f')} GB/s"
            )
    f32 = report["float32"]
    titles = {
        "prefill": "float32 prefill attention, ms per layer: SDPA vs cpu_prefill_f32 (AVX-512 or AVX2)",
        "decode": "float32 decode attention, ms per layer: torch (gather + matmuls) vs C (AVX-512 "
        "or AVX2)",
        "projections": "float32 projections per step (30 layers + LM head), ms: F.linear (MKL) "
        "vs cpu_gemm_f32",
        "elementwise": "float32 RMSNorm + rotary/cache + SiLU-and-mul, one layer, ms: torch vs C",
    }
    for section, title in titles.items():
        if not f32[section]:
            continue
        print(title)
        for r in f32[section]:
            rate = (
                f"{_fmt(r['kernel_gbps'], '.1f')} GB/s of K/V"
                if r.get("kernel_gbps")
                else f"{_fmt(r['kernel_tflops'], '.3f')} TFLOP/s"
            )
            print(
                f"  {r['shape']:>20} {r['torch_ms']:>9.2f} {r['kernel_ms']:>9.2f} "
                f"{r['speedup']:>6.2f}x  {rate}"
            )

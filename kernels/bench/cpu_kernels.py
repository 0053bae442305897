"""`kvfleet bench cpu-kernels`: the CPU kernels against the paths they replace, in one run, at
the bundled model's shapes (9 query / 3 KV heads, head_dim 64, 16-token blocks, hidden 576,
intermediate 1536, vocab 49152, 30 layers, bf16).

- prefill attention: the AMX kernel (`cpu_prefill`) against the torch reference (SDPA over the
  gathered paged context, with the additive mask built once, as the engine does), for whole
  prompts and for suffixes after a cached prefix;
- decode attention: the C kernel's AMX path against its AVX512-BF16 dot path and the torch
  reference (gather + batched matmuls), 128 sequences of 100-700 tokens, rotating through
  enough layer caches that every call reads from memory, not from cache;
- projections: a step's GEMMs (30 layers' distinct qkv, o, gate_up and down weights, then the
  LM head) at 1 to 2048 rows, kvfleet's bf16 kernel (`cpu_gemm`, on its AMX engine or, without
  AMX, its AVX512-BF16 one: the row says which) against oneDNN on its prepacked
  weight (`cpu_linear`), both timed on every row count to show where each wins (`kvfleet bench
  gemm-rows` asks the same of a real run's steps); at decode sizes (up to 16 rows) also with
  the tiles on 2 MiB pages, as the engine holds them (`huge_pages`), against the same tiles on
  4 KiB pages, in turns;
- float32 (the CPU default without AVX512-BF16), where the build has AVX-512: prefill attention
  (`cpu_prefill`'s float32 kernel) against SDPA, a step's projections on `cpu_gemm_f32` against
  F.linear (MKL) at 1 to 128 rows, and one layer's RMSNorm, rotary + cache write and
  SiLU-and-mul in C against torch's ops;
- quantized, where the quantized kernel builds: a step's int4 projections (int8 LM head) on
  `cpu_gemm_quant` against the same weights dequantized per call into the float32 GEMM, at 1
  to 512 rows (`cpu_kernels_quant`).

Every path's output is checked against the torch reference before it is timed (exit code 1 on a
mismatch). Times are the minimum over `--iters` calls (this host's speed drifts; the minimum is
the least disturbed); two paths compared in one row take turns call by call. A path the machine
lacks (no AMX, no AVX512-BF16) is reported as null. Every path runs under the engine's default
kernel policy (AMX's rows compared with the same policy with AMX off). The inputs and timing are
`cpu_kernels_cases`', the float32 rows `cpu_kernels_float32`', the report `cpu_kernels_report`'.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, replace

from kvfleet.kernels.bench import cpu_kernels_float32, cpu_kernels_quant
from kvfleet.kernels.bench.cpu_kernels_cases import (
    BLOCK_SIZE,
    HEAD_DIM,
    HIDDEN,
    INTERMEDIATE,
    NUM_HEADS,
    NUM_KV_HEADS,
    KernelMismatch,
    alternating_min_ms,
    attention_flops,
    decode_case,
    gemm_weights,
    huge_page_tiles,
    min_ms,
    paged_cache,
    step_weights,
    verify,
)
from kvfleet.kernels.bench.cpu_kernels_report import DecodeRow, GemmRow, PrefillRow, print_report
from kvfleet.kernels.policy import DEFAULT_POLICY

# Every path is timed as the engine runs it: under the default kernel policy, or that policy
# with AMX off where a row compares AMX with the vector path beside it.
POLICY = DEFAULT_POLICY
NO_AMX = replace(DEFAULT_POLICY, allow_amx=False)
# (query tokens, context tokens): whole prompts, suffixes over a 1024-token cached prefix, then
# serving steps' chunks 3,000 tokens into a long prompt (the kernel splits their keys; 64
# tokens is the most an AVX2 build gives it at that context, policy.avx2_prefill_short_query).
PREFILL_SHAPES = (
    (512, 512),
    (2048, 2048),
    (272, 1296),
    (450, 1474),
    (4, 3004),
    (16, 3016),
    (48, 3048),
    (64, 3064),
)
DECODE_SEQS = 128
DECODE_LAYERS = 30  # distinct caches per decode timing: ≈ 1.2 GB, far past any cache
GEMM_ROWS = (1, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)
GEMM_LAYERS = 30  # distinct weights per timed step: 212 MB, as the model streams them
HUGE_PAGE_MAX_ROWS = 16  # decode sizes, where streaming the weights sets the pace
# The standard workload's median prompt first, then the bf16 shapes.
F32_PREFILL_SHAPES = ((272, 272), *PREFILL_SHAPES)
F32_GEMM_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
F32_ELEMENTWISE_ROWS = (32, 2048)  # a serving batch's decode step, a full prefill step
# Decode steps (one stream, a speculative verify step of 4 drafts, a batch) and prompts.
QUANT_ROWS = (1, 4, 5, 8, 16, 64, 128, 512)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `cpu-kernels` under `kvfleet bench`."""
    p = subparsers.add_parser(
        "cpu-kernels",
        help="time the CPU kernels against the paths they replace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--iters", type=int, default=10, help="timed calls per path (default 10)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The command: measure, print the report, write it as JSON if asked; 1 on a kernel that
    disagrees with the reference, 2 on a bad flag."""
    if args.iters < 1:
        print("kvfleet bench cpu-kernels: --iters must be >= 1", file=sys.stderr)
        return 2
    try:
        report = measure(args.iters)
    except KernelMismatch as exc:
        print(f"kvfleet bench cpu-kernels: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def prefill_row(torch, q_len: int, ctx: int, iters: int) -> PrefillRow:
    """One prefill shape: the AMX kernel (when available) against the reference's SDPA."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_prefill

    gen = torch.Generator().manual_seed(q_len * 7919 + ctx)
    k, v, tables = paged_cache(torch, [ctx], gen)
    q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    mask = reference.context_mask(q_len, ctx, torch.bfloat16, q.device) if ctx > q_len else None

    def ref():
        return reference.prefill_attention(q, k, v, tables[0], ctx, scale, mask)

    reference_ms = min_ms(ref, iters)
    name = kernel_ms = tflops = None
    if cpu_prefill.available(policy=POLICY) and cpu_prefill.supports(q, k, v, policy=POLICY):
        name = cpu_prefill.bf16_kernel(POLICY)

        def kernel():
            return cpu_prefill.prefill_attention(q, k, v, tables[0], ctx, scale, policy=POLICY)

        verify(torch, f"prefill q={q_len} ctx={ctx} ({name})", kernel(), ref())
        kernel_ms = min_ms(kernel, iters)
        tflops = attention_flops(q_len, ctx) / (kernel_ms * 1e-3) / 1e12
    return PrefillRow(
        q_len, ctx, reference_ms, name, kernel_ms,
        reference_ms / kernel_ms if kernel_ms else None, tflops,
    )  # fmt: skip


def decode_row(
    torch, iters: int, seqs: int = DECODE_SEQS, layers: int = DECODE_LAYERS, shuffled: bool = True
) -> DecodeRow:
    """Decode attention over `layers` distinct caches per timed call (a step's worth), per
    layer: the AMX path, the AVX512-BF16 dot path, and the torch reference."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_attention

    case = decode_case(torch, seqs, layers, shuffled, torch.bfloat16, seed=1)
    want = case.first_layer(reference.decode_attention)
    # The reference gathers a padded copy per call: a few calls tell its speed.
    reference_ms = case.ms_per_layer(reference.decode_attention, min(iters, 3))

    def path_ms(allow_amx: bool) -> float:
        attention = functools.partial(
            cpu_attention.decode_attention, policy=POLICY if allow_amx else NO_AMX
        )
        got = case.first_layer(attention)
        verify(torch, f"decode ({'AMX' if allow_amx else 'dot'} path)", got, want)
        return case.ms_per_layer(attention, iters)

    dot_ms = path_ms(False) if cpu_attention.uses_bf16_dot() else None
    amx_ms = path_ms(True) if cpu_attention.uses_amx() else None
    return DecodeRow(
        "shuffled" if shuffled else "consecutive", seqs, sum(case.lens), reference_ms, dot_ms, amx_ms, case.gbps(dot_ms), case.gbps(amx_ms),
        dot_ms / amx_ms if dot_ms and amx_ms else None,
    )  # fmt: skip


def gemm_row(torch, rows: int, plain, packed, iters: int, huge_tiles=None) -> GemmRow:
    """One step's projections at `rows` rows: oneDNN and (where it runs) cpu_gemm, and with
    `huge_tiles` (`huge_page_tiles`) cpu_gemm on those too, up to HUGE_PAGE_MAX_ROWS rows."""
    from kvfleet.kernels import dispatch
    from kvfleet.kernels.cpu import cpu_gemm, cpu_linear

    gen = torch.Generator().manual_seed(rows)
    inputs = {
        k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)
    }
    # What `cpu_linear.linear` runs without cpu_gemm (row buckets included).
    onednn_only = [
        cpu_linear.PackedLinear(p.onednn, None, p.out_features, p.in_features) for p in packed
    ]

    def onednn_step():
        for p in onednn_only:
            cpu_linear.linear(inputs[p.in_features], p, policy=POLICY)

    def kernel_step():
        for p in packed:
            cpu_gemm.linear(inputs[p.in_features], p.tiles, policy=POLICY)

    def huge_pages_step():
        for p, tiles in zip(packed, huge_tiles, strict=True):
            cpu_gemm.linear(inputs[p.in_features], tiles, policy=POLICY)

    weight_bytes = sum(w.numel() * 2 for w in plain)
    kernel = kernel_ms = huge_ms = None
    if all(p.tiles is not None for p in packed) and cpu_gemm.kernel(POLICY) is not None:
        amx = cpu_gemm.kernel(POLICY) == cpu_gemm.KERNEL_AMX
        kernel = dispatch.PATH_AMX if amx else dispatch.PATH_AVX512_BF16
        for w, p in zip(plain[:4] + plain[-1:], packed[:4] + packed[-1:], strict=True):
            x = inputs[w.shape[1]]
            got = cpu_gemm.linear(x, p.tiles, policy=POLICY)
            want = torch.nn.functional.linear(x, w)
            verify(torch, f"projection {tuple(w.shape)} at {rows} rows ({kernel})", got, want)
        steps = [onednn_step, kernel_step]
        if huge_tiles is not None and rows <= HUGE_PAGE_MAX_ROWS:
            x = inputs[packed[0].in_features]
            if not torch.equal(
                cpu_gemm.linear(x, huge_tiles[0], policy=POLICY),
                cpu_gemm.linear(x, packed[0].tiles, policy=POLICY),
            ):
                raise KernelMismatch(f"projection tiles on 2 MiB pages at {rows} rows: other bits")
            steps.append(huge_pages_step)
        onednn_ms, kernel_ms, *rest = alternating_min_ms(steps, iters)
        huge_ms = rest[0] if rest else None
    else:
        onednn_ms = min_ms(onednn_step, iters)

    def gbps(ms):
        return weight_bytes / (ms * 1e-3) / 1e9 if ms else None

    row = GemmRow(
        rows, weight_bytes / 1e6, onednn_ms, kernel, kernel_ms, gbps(onednn_ms), gbps(kernel_ms),
        onednn_ms / kernel_ms if kernel_ms else None,
    )  # fmt: skip
    row.kernel_huge_pages_ms, row.kernel_huge_pages_gbps = huge_ms, gbps(huge_ms)
    if kernel_ms is not None and rows <= cpu_gemm.max_rows(POLICY):
        row.separate_ops_ms, row.fused_ops_ms = _layer_ops_ms(torch, rows, packed[:-1], iters)
    return row


def _layer_ops_ms(torch, rows: int, layers_packed, iters: int) -> tuple[float, float]:
    """The layers' norm → qkv, o, norm → gate/up, gate → down, as separate calls and fused;
    checked to give the same bits first."""
    from kvfleet.kernels import dispatch

    kernels = dispatch.Kernels(POLICY)

    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    layers = [layers_packed[i : i + 4] for i in range(0, len(layers_packed), 4)]

    def separate(qkv, o, gu, down, res):
        normed, res = kernels.rms_norm(x, norm_w, 1e-5, res)
        outs = [kernels.linear(normed, qkv), kernels.linear(x, o)]
        normed, res = kernels.rms_norm(x, norm_w, 1e-5, res)
        gated = kernels.silu_and_mul(gate_up)
        return [*outs, kernels.linear(normed, gu), kernels.linear(gated, down), res]

    def fused(qkv, o, gu, down, res):
        first, res = kernels.rms_norm_linear(x, norm_w, 1e-5, res, qkv)
        third, res = kernels.rms_norm_linear(x, norm_w, 1e-5, res, gu)
        down_out = kernels.silu_and_mul_linear(gate_up, down)
        return [first, kernels.linear(x, o), third, down_out, res]

    want, got = (f(*layers[0], residual.clone()) for f in (separate, fused))
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise KernelMismatch(f"fused norm/gate at {rows} rows: not the separate calls' bits")

    def step(f):
        return lambda: [f(*layer, residual) for layer in layers]

    separate_ms, fused_ms = alternating_min_ms([step(separate), step(fused)], iters)
    return separate_ms, fused_ms


def float32_rows(torch, iters: int) -> dict:
    """The float32 sections, or empty ones where the build has neither AVX-512 nor AVX2 + FMA
    (no kernel to time)."""
    from kvfleet.kernels.cpu import cpu_gemm_f32

    if not cpu_gemm_f32.available():
        return {"prefill": [], "decode": [], "projections": [], "elementwise": []}
    weights = step_weights(torch, GEMM_LAYERS, torch.float32)
    return {
        "prefill": [
            asdict(cpu_kernels_float32.prefill_row(torch, q, c, iters))
            for q, c in F32_PREFILL_SHAPES
        ],
        "decode": [
            asdict(cpu_kernels_float32.decode_row(torch, iters, DECODE_SEQS, DECODE_LAYERS, order))
            for order in (True, False)
        ],
        "projections": [
            asdict(cpu_kernels_float32.gemm_row(torch, r, weights, iters)) for r in F32_GEMM_ROWS
        ],
        "elementwise": [
            asdict(cpu_kernels_float32.elementwise_row(torch, r, iters))
            for r in F32_ELEMENTWISE_ROWS
        ],
    }


def read_gbps(torch, iters: int) -> float:
    """This machine's memory read rate: a float32 sum over 1 GiB (a bf16 sum is bound by its
    conversion, not by memory)."""
    x = torch.ones(2**28)
    return x.numel() * 4 / (min_ms(x.sum, iters) * 1e-3) / 1e9


def measure(iters: int) -> dict:
    """Every section's rows, each path checked against the reference first (else
    KernelMismatch): the report `cpu_kernels_report` prints."""
    import torch
    from kvfleet.kernels.cpu import cpu_attention, cpu_prefill

    return {
        "device": _cpu_name(),
        "threads": torch.get_num_threads(),
        "shapes": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
        },
        "amx": cpu_prefill.bf16_kernel(POLICY) == cpu_prefill.KERNEL_AMX,
        "bf16_prefill_kernel": cpu_prefill.bf16_kernel(POLICY),
        "avx512_bf16_dot": cpu_attention.uses_bf16_dot(),
        "verified_against_reference": True,  # every path, before timing (else KernelMismatch)
        "read_gbps": read_gbps(torch, iters),
        "prefill": [asdict(prefill_row(torch, q, c, iters)) for q, c in PREFILL_SHAPES],
        "decode": [
            asdict(decode_row(torch, iters, DECODE_SEQS, DECODE_LAYERS, shuffled))
            for shuffled in (True, False)
        ],
        "projections": gemm_rows(torch, iters),
        "float32": float32_rows(torch, iters),
        "quantized": quantized_rows(torch, iters),
    }


def quantized_rows(torch, iters: int) -> list[dict]:
    """The quantized projection rows, or none where the quantized kernel does not build."""
    from kvfleet.kernels.cpu import cpu_gemm_quant

    if not cpu_gemm_quant.available():
        return []
    weights = cpu_kernels_quant.step_weights_quantized(torch, GEMM_LAYERS)
    return [asdict(cpu_kernels_quant.quant_row(torch, r, weights, iters)) for r in QUANT_ROWS]


def gemm_rows(torch, iters: int) -> list[dict]:
    """The projection rows, or none where bf16 weights are not packed (no oneDNN bf16 GEMM, or
    bf16 only emulated): nothing to compare."""
    from kvfleet.kernels.cpu import cpu_linear

    if not cpu_linear.available():
        return []
    plain, packed = gemm_weights(torch, GEMM_LAYERS)
    huge_tiles = huge_page_tiles(packed)
    return [asdict(gemm_row(torch, rows, plain, packed, iters, huge_tiles)) for rows in GEMM_ROWS]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"

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
  SiLU-and-mul in C against torch's ops.

Every path's output is checked against the torch reference before it is timed (exit code 1 on a
mismatch). Times are the minimum over `--iters` calls (this host's speed drifts; the minimum is
the least disturbed); two paths compared in one row take turns call by call. A path the machine
lacks (no AMX, no AVX512-BF16) is reported as null.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# (query tokens, context tokens): whole prompts, then suffixes over a 1024-token cached prefix.
PREFILL_SHAPES = ((512, 512), (2048, 2048), (272, 1296), (450, 1474))
DECODE_SEQS, DECODE_MIN_CTX, DECODE_MAX_CTX = 128, 100, 700
DECODE_LAYERS = 30  # distinct caches per decode timing: ≈ 1.2 GB, far past any cache
HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
GEMM_ROWS = (1, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)
GEMM_LAYERS = 30  # distinct weights per timed step: 212 MB, as the model streams them
HUGE_PAGE_MAX_ROWS = 16  # decode sizes, where streaming the weights sets the pace
VERIFY_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}  # bf16 outputs, float32 accumulation in all
F32_VERIFY_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
# The standard workload's median prompt first, then the bf16 shapes.
F32_PREFILL_SHAPES = ((272, 272), *PREFILL_SHAPES)
F32_GEMM_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
F32_ELEMENTWISE_ROWS = (32, 2048)  # a serving batch's decode step, a full prefill step


class KernelMismatch(AssertionError):
    """A kernel's output disagrees with the torch reference: its timing would mean nothing."""


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


def min_ms(call: Callable[[], object], iters: int) -> float:
    """The fastest of `iters` calls after one untimed call, in milliseconds."""
    return alternating_min_ms([call], iters)[0]


def alternating_min_ms(calls: list[Callable[[], object]], iters: int) -> list[float]:
    """Each call's fastest of `iters`, in milliseconds, the calls taking turns (after one
    untimed round): paths compared in one row then see the same phases of a drifting host."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(iters):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


def _verify(torch, name: str, got, want, tolerance=VERIFY_TOLERANCE) -> None:
    try:
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
    except AssertionError as exc:
        raise KernelMismatch(f"{name}: disagrees with the torch reference\n{exc}") from None


def _paged_cache(torch, lens: list[int], gen, shuffled: bool = True, dtype=None):
    """Head-major K/V caches (bf16 unless `dtype`) holding sequences of `lens` tokens, and their
    block tables:
    blocks in shuffled order, or each sequence's blocks consecutive in memory (as a prompt's
    blocks are, allocated together; the standard workload's block tables are 75-97% consecutive
    neighbours)."""
    from kvfleet.kernels import reference

    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    dtype = dtype or torch.bfloat16
    k, v = reference.allocate_kv_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                       dtype, "cpu", head_major=True)  # fmt: skip
    k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
    v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    order = (
        torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(num_blocks)
    ).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used : used + n]
        used += n
    return k, v, tables


def prefill_row(torch, q_len: int, ctx: int, iters: int) -> PrefillRow:
    """One prefill shape: the AMX kernel (when available) against the reference's SDPA."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_prefill

    gen = torch.Generator().manual_seed(q_len * 7919 + ctx)
    k, v, tables = _paged_cache(torch, [ctx], gen)
    q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    mask = reference.context_mask(q_len, ctx, torch.bfloat16, q.device) if ctx > q_len else None

    def ref():
        return reference.prefill_attention(q, k, v, tables[0], ctx, scale, mask)

    reference_ms = min_ms(ref, iters)
    name = kernel_ms = tflops = None
    if cpu_prefill.available() and cpu_prefill.supports(q, k, v):
        name = cpu_prefill.bf16_kernel()

        def kernel():
            return cpu_prefill.prefill_attention(q, k, v, tables[0], ctx, scale)

        _verify(torch, f"prefill q={q_len} ctx={ctx} ({name})", kernel(), ref())
        kernel_ms = min_ms(kernel, iters)
        tflops = _attention_flops(q_len, ctx) / (kernel_ms * 1e-3) / 1e12
    return PrefillRow(
        q_len, ctx, reference_ms, name, kernel_ms,
        reference_ms / kernel_ms if kernel_ms else None, tflops,
    )  # fmt: skip


def _attention_flops(q_len: int, ctx: int) -> float:
    """q . k and p . v over the visible (causal) pairs, 2 FLOPs per multiply-add."""
    pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2
    return 4 * NUM_HEADS * HEAD_DIM * pairs


@dataclass(slots=True)
class DecodeCase:
    """A decode step's attention inputs: `seqs` sequences of 100-700 tokens over `layers`
    distinct K/V caches (a step's worth, far past any CPU cache), shared by the bf16 and float32
    rows."""

    lens: list[int]
    caches: list  # (k, v, block tables) per layer
    q: object
    seq_lens: object
    max_len: int
    scale: float

    def first_layer(self, fn):
        """`fn`'s output for the first layer's cache (what a path is verified on)."""
        k, v, tables = self.caches[0]
        return fn(self.q, k, v, tables, self.seq_lens, self.max_len, self.scale)

    def ms_per_layer(self, fn, iters: int) -> float:
        """The minimum over `iters` calls of `fn` over every layer's cache, per layer."""

        def call():
            for k, v, tables in self.caches:
                fn(self.q, k, v, tables, self.seq_lens, self.max_len, self.scale)

        return min_ms(call, iters) / len(self.caches)

    def gbps(self, ms: float | None) -> float | None:
        """The K/V read rate of a layer taking `ms`."""
        itemsize = self.caches[0][0].element_size()
        kv_bytes = sum(self.lens) * NUM_KV_HEADS * HEAD_DIM * itemsize * 2  # K and V
        return kv_bytes / (ms * 1e-3) / 1e9 if ms else None


def decode_case(torch, seqs: int, layers: int, shuffled: bool, dtype, seed: int) -> DecodeCase:
    """A DecodeCase in `dtype` (caches and queries), the same context lengths for every dtype."""
    rng = random.Random(0)
    lens = [rng.randint(DECODE_MIN_CTX, DECODE_MAX_CTX) for _ in range(seqs)]
    gen = torch.Generator().manual_seed(seed)
    caches = [_paged_cache(torch, lens, gen, shuffled, dtype) for _ in range(layers)]
    q = torch.randn(seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return DecodeCase(lens, caches, q, seq_lens, max(lens), HEAD_DIM**-0.5)


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
        previous = cpu_attention.ALLOW_AMX
        cpu_attention.ALLOW_AMX = allow_amx
        try:
            got = case.first_layer(cpu_attention.decode_attention)
            _verify(torch, f"decode ({'AMX' if allow_amx else 'dot'} path)", got, want)
            return case.ms_per_layer(cpu_attention.decode_attention, iters)
        finally:
            cpu_attention.ALLOW_AMX = previous

    dot_ms = path_ms(False) if cpu_attention.uses_bf16_dot() else None
    amx_ms = path_ms(True) if cpu_attention.uses_amx() else None
    return DecodeRow(
        "shuffled" if shuffled else "consecutive", seqs, sum(case.lens), reference_ms, dot_ms, amx_ms, case.gbps(dot_ms), case.gbps(amx_ms),
        dot_ms / amx_ms if dot_ms and amx_ms else None,
    )  # fmt: skip


def step_weights(torch, layers: int, dtype) -> list:
    """A step's plain [out, in] weights: `layers` layers' qkv, o, gate_up and down, then the LM
    head."""
    gen = torch.Generator().manual_seed(2)
    qkv = (HIDDEN + 2 * NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    layer = [
        qkv,
        (HIDDEN, NUM_HEADS * HEAD_DIM),
        (2 * INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ]
    shapes = layer * layers + [(VOCAB, HIDDEN)]
    return [(torch.randn(shape, generator=gen) * 0.05).to(dtype) for shape in shapes]


def gemm_weights(torch, layers: int):
    """`layers` layers' projection weights and an LM head, each packed for `dispatch.linear`,
    with their plain [out, in] shapes."""
    from kvfleet.kernels.cpu import cpu_linear

    plain = step_weights(torch, layers, torch.bfloat16)
    return plain, [cpu_linear.pack(w) for w in plain]


def huge_page_tiles(packed) -> list | None:
    """Copies of the packed weights' cpu_gemm tiles on 2 MiB pages, as the engine's prepack
    places them; None where the kernel has no tiles or the kernel gives no such pages."""
    from kvfleet.kernels.cpu import huge_pages

    if not huge_pages.enabled() or any(p.tiles is None for p in packed):
        return None
    arena = huge_pages.HugePageArena()
    tiles = [arena.copy(p.tiles) for p in packed]
    return tiles if all(huge_pages.on_huge_pages(t) for t in tiles) else None


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
            cpu_linear.linear(inputs[p.in_features], p)

    def kernel_step():
        for p in packed:
            cpu_gemm.linear(inputs[p.in_features], p.tiles)

    def huge_pages_step():
        for p, tiles in zip(packed, huge_tiles, strict=True):
            cpu_gemm.linear(inputs[p.in_features], tiles)

    weight_bytes = sum(w.numel() * 2 for w in plain)
    kernel = kernel_ms = huge_ms = None
    if all(p.tiles is not None for p in packed) and cpu_gemm.available():
        amx = cpu_gemm.kernel() == cpu_gemm.KERNEL_AMX
        kernel = dispatch.PATH_AMX if amx else dispatch.PATH_AVX512_BF16
        for w, p in zip(plain[:4] + plain[-1:], packed[:4] + packed[-1:], strict=True):
            x = inputs[w.shape[1]]
            got = cpu_gemm.linear(x, p.tiles)
            want = torch.nn.functional.linear(x, w)
            _verify(torch, f"projection {tuple(w.shape)} at {rows} rows ({kernel})", got, want)
        steps = [onednn_step, kernel_step]
        if huge_tiles is not None and rows <= HUGE_PAGE_MAX_ROWS:
            x = inputs[packed[0].in_features]
            if not torch.equal(
                cpu_gemm.linear(x, huge_tiles[0]), cpu_gemm.linear(x, packed[0].tiles)
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
    if kernel_ms is not None and rows <= cpu_gemm.max_rows():
        row.separate_ops_ms, row.fused_ops_ms = _layer_ops_ms(torch, rows, packed[:-1], iters)
    return row


def _layer_ops_ms(torch, rows: int, layers_packed, iters: int) -> tuple[float, float]:
    """The layers' norm → qkv, o, norm → gate/up, gate → down, as separate calls and fused;
    checked to give the same bits first."""
    from kvfleet.kernels import dispatch

    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    layers = [layers_packed[i : i + 4] for i in range(0, len(layers_packed), 4)]

    def separate(qkv, o, gu, down, res):
        normed, res = dispatch.rms_norm(x, norm_w, 1e-5, res)
        outs = [dispatch.linear(normed, qkv), dispatch.linear(x, o)]
        normed, res = dispatch.rms_norm(x, norm_w, 1e-5, res)
        gated = dispatch.silu_and_mul(gate_up)
        return [*outs, dispatch.linear(normed, gu), dispatch.linear(gated, down), res]

    def fused(qkv, o, gu, down, res):
        first, res = dispatch.rms_norm_linear(x, norm_w, 1e-5, res, qkv)
        third, res = dispatch.rms_norm_linear(x, norm_w, 1e-5, res, gu)
        down_out = dispatch.silu_and_mul_linear(gate_up, down)
        return [first, dispatch.linear(x, o), third, down_out, res]

    want, got = (f(*layers[0], residual.clone()) for f in (separate, fused))
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise KernelMismatch(f"fused norm/gate at {rows} rows: not the separate calls' bits")

    def step(f):
        return lambda: [f(*layer, residual) for layer in layers]

    separate_ms, fused_ms = alternating_min_ms([step(separate), step(fused)], iters)
    return separate_ms, fused_ms


def float32_prefill_row(torch, q_len: int, ctx: int, iters: int) -> Float32Row:
    """One prefill shape in float32: cpu_prefill_f32 (AVX-512 or AVX2, as built) against the
    reference's SDPA."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_prefill

    gen = torch.Generator().manual_seed(q_len * 7919 + ctx)
    k, v, tables = _paged_cache(torch, [ctx], gen, dtype=torch.float32)
    q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    mask = reference.context_mask(q_len, ctx, torch.float32, q.device) if ctx > q_len else None

    def ref():
        return reference.prefill_attention(q, k, v, tables[0], ctx, scale, mask)

    def kernel():
        return cpu_prefill.prefill_attention(q, k, v, tables[0], ctx, scale)

    name = f"float32 prefill q={q_len} ctx={ctx}"
    _verify(torch, name, kernel(), ref(), F32_VERIFY_TOLERANCE)
    torch_ms, kernel_ms = alternating_min_ms([ref, kernel], iters)
    tflops = _attention_flops(q_len, ctx) / (kernel_ms * 1e-3) / 1e12
    return Float32Row(f"q={q_len} ctx={ctx}", torch_ms, kernel_ms, torch_ms / kernel_ms, tflops)


def float32_gemm_row(torch, rows: int, weights: list, iters: int) -> Float32Row:
    """A step's projections at `rows` rows in float32: `cpu_gemm_f32` (called directly, also
    outside the rows dispatch routes to it, to show the crossovers) against F.linear."""
    from kvfleet.kernels.cpu import cpu_gemm_f32

    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
    for w in weights[:4] + weights[-1:]:
        x = inputs[w.shape[1]]
        got, want = cpu_gemm_f32.linear(x, w), torch.nn.functional.linear(x, w)
        _verify(torch, f"float32 projection {tuple(w.shape)} at {rows} rows", got, want,
                F32_VERIFY_TOLERANCE)  # fmt: skip

    def step(fn):
        return lambda: [fn(inputs[w.shape[1]], w) for w in weights]

    mkl_ms, kernel_ms = alternating_min_ms(
        [step(torch.nn.functional.linear), step(cpu_gemm_f32.linear)], iters
    )
    flops = 2 * rows * sum(w.numel() for w in weights)
    return Float32Row(
        f"rows={rows}", mkl_ms, kernel_ms, mkl_ms / kernel_ms, flops / (kernel_ms * 1e-3) / 1e12
    )


def float32_elementwise_row(torch, rows: int, iters: int) -> Float32Row:
    """One layer's RMSNorm (with residual), rotary + K/V cache write and SiLU-and-mul in float32:
    the C kernels against torch's ops (the reference rotary, the C cache write)."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_cache, cpu_elementwise

    gen = torch.Generator().manual_seed(rows + 3)
    x = torch.randn(rows, HIDDEN, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=gen)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen)
    cos_sin = torch.randn(4096, HEAD_DIM, generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    k_cache, v_cache = reference.allocate_kv_cache(-(-rows // BLOCK_SIZE), BLOCK_SIZE,
                                                   NUM_KV_HEADS, HEAD_DIM, torch.float32, "cpu",
                                                   head_major=True)  # fmt: skip
    slots = torch.arange(rows)

    def views(t):
        return (t[:, :q_size].view(rows, NUM_HEADS, HEAD_DIM),
                t[:, q_size : q_size + kv_size].view(rows, NUM_KV_HEADS, HEAD_DIM),
                t[:, q_size + kv_size :].view(rows, NUM_KV_HEADS, HEAD_DIM))  # fmt: skip

    # Rotation is in place: each call works on a fresh copy of the step's qkv rows.
    def torch_ops():
        q, k, v = views(qkv.clone())
        normed, _ = reference.rms_norm(x, norm_w, 1e-5, residual)
        q, k = reference.rotary_embedding(positions, q, k, cos_sin)
        cpu_cache.reshape_and_cache(k, v, k_cache, v_cache, slots)
        return normed, q, reference.silu_and_mul(gate_up)

    def kernels():
        q, k, v = views(qkv.clone())
        normed, _ = cpu_elementwise.rms_norm(x, norm_w, 1e-5, residual.clone())
        q = cpu_elementwise.rotary_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
        return normed, q, cpu_elementwise.silu_and_mul(gate_up)

    for name, got, want in zip(("RMSNorm", "rotary", "SiLU-and-mul"), kernels(), torch_ops(),
                               strict=True):  # fmt: skip
        _verify(torch, f"float32 {name} at {rows} rows", got, want, F32_VERIFY_TOLERANCE)
    torch_ms, kernel_ms = alternating_min_ms([torch_ops, kernels], iters)
    return Float32Row(f"rows={rows}", torch_ms, kernel_ms, torch_ms / kernel_ms, None)


def float32_decode_row(
    torch, iters: int, seqs: int = DECODE_SEQS, layers: int = DECODE_LAYERS, shuffled: bool = True
) -> Float32Row:
    """Decode attention on a float32 cache (the C kernel's portable path, built for AVX-512 or
    AVX2) against the torch reference, over `layers` distinct caches per timed call."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_attention

    case = decode_case(torch, seqs, layers, shuffled, torch.float32, seed=2)
    _verify(torch, "float32 decode attention", case.first_layer(cpu_attention.decode_attention),
            case.first_layer(reference.decode_attention), F32_VERIFY_TOLERANCE)  # fmt: skip
    # The reference gathers a padded copy per call: a few calls tell its speed.
    torch_ms = case.ms_per_layer(reference.decode_attention, min(iters, 3))
    kernel_ms = case.ms_per_layer(cpu_attention.decode_attention, iters)
    order = "shuffled" if shuffled else "consecutive"
    return Float32Row(f"seqs={seqs} {order}", torch_ms, kernel_ms, torch_ms / kernel_ms, None,
                      case.gbps(kernel_ms))  # fmt: skip


def float32_rows(torch, iters: int) -> dict:
    """The float32 sections, or empty ones where the build has neither AVX-512 nor AVX2 + FMA
    (no kernel to time)."""
    from kvfleet.kernels.cpu import cpu_gemm_f32

    if not cpu_gemm_f32.available():
        return {"prefill": [], "decode": [], "projections": [], "elementwise": []}
    weights = step_weights(torch, GEMM_LAYERS, torch.float32)
    return {
        "prefill": [asdict(float32_prefill_row(torch, q, c, iters)) for q, c in F32_PREFILL_SHAPES],
        "decode": [
            asdict(float32_decode_row(torch, iters, DECODE_SEQS, DECODE_LAYERS, shuffled))
            for shuffled in (True, False)
        ],
        "projections": [asdict(float32_gemm_row(torch, r, weights, iters)) for r in F32_GEMM_ROWS],
        "elementwise": [
            asdict(float32_elementwise_row(torch, r, iters)) for r in F32_ELEMENTWISE_ROWS
        ],
    }


def read_gbps(torch, iters: int) -> float:
    """This machine's memory read rate: a float32 sum over 1 GiB (a bf16 sum is bound by its
    conversion, not by memory)."""
    x = torch.ones(2**28)
    return x.numel() * 4 / (min_ms(x.sum, iters) * 1e-3) / 1e9


def measure(iters: int) -> dict:
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
        "amx": cpu_prefill.bf16_kernel() == cpu_prefill.KERNEL_AMX,
        "bf16_prefill_kernel": cpu_prefill.bf16_kernel(),
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
    }


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


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_report(report: dict) -> None:
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

"""`kvfleet bench cpu-kernels`' float32 rows (the CPU default without AVX512-BF16), where the
build has AVX-512 or AVX2 + FMA: prefill attention on `cpu_prefill`'s float32 kernel against
SDPA, a step's projections on `cpu_gemm_f32` against F.linear (MKL), one layer's RMSNorm, rotary
+ cache write and SiLU-and-mul in C against torch's ops, and decode attention on a float32 cache
against the torch reference."""

from __future__ import annotations

import functools

from kvfleet.kernels.bench.cpu_kernels_cases import (
    BLOCK_SIZE,
    F32_VERIFY_TOLERANCE,
    HEAD_DIM,
    HIDDEN,
    INTERMEDIATE,
    NUM_HEADS,
    NUM_KV_HEADS,
    alternating_min_ms,
    attention_flops,
    decode_case,
    paged_cache,
    verify,
)
from kvfleet.kernels.bench.cpu_kernels_report import Float32Row
from kvfleet.kernels.policy import DEFAULT_POLICY

# The engine's default kernel policy: the paths it runs in float32.
POLICY = DEFAULT_POLICY


def prefill_row(torch, q_len: int, ctx: int, iters: int) -> Float32Row:
    """One prefill shape in float32: cpu_prefill_f32 (AVX-512 or AVX2, as built) against the
    reference's SDPA."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_prefill

    gen = torch.Generator().manual_seed(q_len * 7919 + ctx)
    k, v, tables = paged_cache(torch, [ctx], gen, dtype=torch.float32)
    q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    mask = reference.context_mask(q_len, ctx, torch.float32, q.device) if ctx > q_len else None

    def ref():
        return reference.prefill_attention(q, k, v, tables[0], ctx, scale, mask)

    def kernel():
        return cpu_prefill.prefill_attention(q, k, v, tables[0], ctx, scale, policy=POLICY)

    name = f"float32 prefill q={q_len} ctx={ctx}"
    verify(torch, name, kernel(), ref(), F32_VERIFY_TOLERANCE)
    torch_ms, kernel_ms = alternating_min_ms([ref, kernel], iters)
    tflops = attention_flops(q_len, ctx) / (kernel_ms * 1e-3) / 1e12
    return Float32Row(f"q={q_len} ctx={ctx}", torch_ms, kernel_ms, torch_ms / kernel_ms, tflops)


def gemm_row(torch, rows: int, weights: list, iters: int) -> Float32Row:
    """A step's projections at `rows` rows in float32: `cpu_gemm_f32` (called directly, also
    outside the rows dispatch routes to it, to show the crossovers) against F.linear."""
    from kvfleet.kernels.cpu import cpu_gemm_f32

    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, INTERMEDIATE)}
    for w in weights[:4] + weights[-1:]:
        x = inputs[w.shape[1]]
        got, want = cpu_gemm_f32.linear(x, w), torch.nn.functional.linear(x, w)
        verify(torch, f"float32 projection {tuple(w.shape)} at {rows} rows", got, want,
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


def elementwise_row(torch, rows: int, iters: int) -> Float32Row:
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
        verify(torch, f"float32 {name} at {rows} rows", got, want, F32_VERIFY_TOLERANCE)
    torch_ms, kernel_ms = alternating_min_ms([torch_ops, kernels], iters)
    return Float32Row(f"rows={rows}", torch_ms, kernel_ms, torch_ms / kernel_ms, None)


def decode_row(torch, iters: int, seqs: int, layers: int, shuffled: bool = True) -> Float32Row:
    """Decode attention on a float32 cache (the C kernel's portable path, built for AVX-512 or
    AVX2) against the torch reference, `seqs` sequences over `layers` distinct caches per timed
    call."""
    from kvfleet.kernels import reference
    from kvfleet.kernels.cpu import cpu_attention

    case = decode_case(torch, seqs, layers, shuffled, torch.float32, seed=2)
    attention = functools.partial(cpu_attention.decode_attention, policy=POLICY)
    verify(torch, "float32 decode attention", case.first_layer(attention),
           case.first_layer(reference.decode_attention), F32_VERIFY_TOLERANCE)  # fmt: skip
    # The reference gathers a padded copy per call: a few calls tell its speed.
    torch_ms = case.ms_per_layer(reference.decode_attention, min(iters, 3))
    kernel_ms = case.ms_per_layer(attention, iters)
    order = "shuffled" if shuffled else "consecutive"
    return Float32Row(f"seqs={seqs} {order}", torch_ms, kernel_ms, torch_ms / kernel_ms, None,
                      case.gbps(kernel_ms))  # fmt: skip

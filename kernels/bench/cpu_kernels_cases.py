"""`kvfleet bench cpu-kernels`' cases and timing: the bundled model's shapes, the inputs each row
times (paged caches, a decode step's attention inputs, a step's weights, packed and on 2 MiB
pages), how a row checks a path against the torch reference before timing it, and how it times
paths (the minimum of calls taking turns)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DECODE_MIN_CTX, DECODE_MAX_CTX = 100, 700
HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
VERIFY_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}  # bf16 outputs, float32 accumulation in all
F32_VERIFY_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


class KernelMismatch(AssertionError):
    """A kernel's output disagrees with the torch reference: its timing would mean nothing."""


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


def verify(torch, name: str, got, want, tolerance=VERIFY_TOLERANCE) -> None:
    """KernelMismatch naming `name` where `got` is not `want` within `tolerance`."""
    try:
        torch.testing.assert_close(got.float(), want.float(), **tolerance)
    except AssertionError as exc:
        raise KernelMismatch(f"{name}: disagrees with the torch reference\n{exc}") from None


def paged_cache(torch, lens: list[int], gen, shuffled: bool = True, dtype=None):
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


def attention_flops(q_len: int, ctx: int) -> float:
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
    caches = [paged_cache(torch, lens, gen, shuffled, dtype) for _ in range(layers)]
    q = torch.randn(seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return DecodeCase(lens, caches, q, seq_lens, max(lens), HEAD_DIM**-0.5)


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

"""Random paged-attention inputs shared by the kernel tests: ragged lengths that hit block
boundaries, and block tables drawn from a random permutation of the physical blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from kvfleet.kernels import reference
from kvfleet.kernels.metadata import AttentionMetadata

# Attention outputs are convex combinations of V rows ~ N(0, 1): bf16 storage of the
# probabilities and the output rounds at ~2^-8 relative, accumulated over the context.
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none): tests assert
    that a kernel runs wherever the CPU can run it, so its cases never skip silently."""
    info = Path("/proc/cpuinfo")
    return set(info.read_text().split()) if info.exists() else set()


def cpu_has_amx() -> bool:
    return {"amx_bf16", "amx_tile"} <= cpu_flags()


@dataclass(slots=True)
class PagedCase:
    """A filled paged KV cache and the block tables that address it."""

    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [seqs]


def ragged_lengths(gen: torch.Generator, batch: int, block_size: int, max_len: int) -> list[int]:
    """Lengths that include 1, exactly on a block boundary and one past it, plus random ones."""
    special = [1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, max_len]
    out = []
    for i in range(batch):
        if i < len(special):
            out.append(min(special[i], max_len))
        else:
            out.append(int(torch.randint(1, max_len + 1, (1,), generator=gen)))
    perm = torch.randperm(batch, generator=gen).tolist()
    return [out[p] for p in perm]


def paged_case(
    gen: torch.Generator,
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> PagedCase:
    """A cache with a few spare blocks; each sequence's blocks are a random, non-contiguous set."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at a real block: kernels must mask by length, not by table.
    tables = torch.full((len(seq_lens), max_blocks + 1), int(perm[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return PagedCase(k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32))


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache contents in the head-major storage the torch path allocates."""
    out, _ = reference.allocate_kv_cache(*cache.shape[:3], cache.shape[3], cache.dtype, "cpu",
                                         head_major=True)  # fmt: skip
    out.copy_(cache)
    return out


def attention_metadata(
    case: PagedCase, query_lens: list[int], num_decodes: int, block_size: int
) -> AttentionMetadata:
    """Metadata for a batch whose sequence i has query_lens[i] new tokens at its end."""
    seq_lens = case.seq_lens.tolist()
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(n - q, n):
            slots.append(
                int(case.block_tables[i, pos // block_size]) * block_size + pos % block_size
            )
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=case.seq_lens,
        block_tables=case.block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=list(query_lens),
        seq_lens_host=seq_lens,
    )


def dense_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain causal softmax(QK^T)V in float64 for one sequence: query [q, H, D] are the last q
    positions of contiguous k/v [ctx, KVH, D]."""
    q_len, heads, _ = query.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q_len):
            pos = ctx - q_len + i
            s = (query[i, h].double() @ kh[: pos + 1].T) * scale
            p = torch.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh[: pos + 1]
    return out


def contiguous_context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's cached tokens [length, KVH, D], gathered token by token (no block math)."""
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows)


def record_rows(monkeypatch, module: object, name: str) -> list[int]:
    """Wrap `module.name` so each call appends its first argument's row count (shape[0]) to the
    returned list, then runs the real function: which steps a dispatch sent to a kernel."""
    rows: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(
        module, name, lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k)
    )
    return rows

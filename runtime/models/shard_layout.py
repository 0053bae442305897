"""Which slice of each weight one tensor-parallel rank holds (Megatron-style), as pure data.

Attention is split by KV-head group: a rank holds whole groups (its KV heads and every query
head that reads them), so attention needs no communication until the output projection. When
the groups do not divide evenly among the ranks the split is uneven (SmolLM2-135M's 3 groups
over 2 ranks: 2 and 1); ranks then wait on the busiest one in attention, but every number is
exact. With more ranks than KV heads each KV head is replicated on the ranks that share its
group, which needs the ranks to divide the query heads and be a multiple of the KV heads.
The MLP's intermediate dimension and the vocabulary are split in balanced contiguous ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]  # [start, stop)


class TensorParallelError(ValueError):
    """The tensor-parallel size does not fit the model; the message names both."""


def split_range(n: int, parts: int, index: int) -> Range:
    """Part `index` of `parts` balanced contiguous ranges over [0, n): the first n % parts
    ranges hold one more element."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def check_tensor_parallel_size(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise TensorParallelError unless `size` ranks can share these attention heads."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size: must be >= 1, got {size}")
    if size <= num_kv_heads:
        return
    if size > num_heads or num_heads % size or size % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size: {size} does not fit the model's {num_heads} attention heads "
            f"and {num_kv_heads} KV heads; use at most {num_kv_heads} (whole KV-head groups "
            f"per rank), or a size that divides {num_heads} and is a multiple of {num_kv_heads}"
        )


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What rank `rank` of `size` holds: query heads, KV heads, MLP intermediate columns and
    vocabulary rows, each a [start, stop) range of the full model's."""

    rank: int
    size: int
    q_heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    vocab_size: int  # the full vocabulary, to put gathered logits back together

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def vocab_ranges(self) -> list[Range]:
        """Every rank's vocabulary range, rank order (the order logits are gathered in)."""
        return [split_range(self.vocab_size, self.size, r) for r in range(self.size)]


def shard_layout(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    size: int = 1,
    rank: int = 0,
) -> ShardLayout:
    """Rank `rank`'s share of a model with these dimensions over `size` ranks (size 1: all)."""
    check_tensor_parallel_size(num_heads, num_kv_heads, size)
    if not 0 <= rank < size:
        raise TensorParallelError(f"rank: must be in [0, {size}), got {rank}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if size <= num_kv_heads:
        kv = split_range(num_kv_heads, size, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        per_rank = num_heads // size
        q = (rank * per_rank, (rank + 1) * per_rank)
        kv_head = q[0] // group  # one group holds all of them: size is a multiple of the KV heads
        kv = (kv_head, kv_head + 1)
    return ShardLayout(
        rank=rank,
        size=size,
        q_heads=q,
        kv_heads=kv,
        intermediate=split_range(intermediate_size, size, rank),
        vocab=split_range(vocab_size, size, rank),
        vocab_size=vocab_size,
    )

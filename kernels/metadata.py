"""What one forward step tells attention about its batch.

The scheduler orders every batch decodes first: the first `num_decodes` sequences have exactly one
query token each, so a decode kernel takes tokens [0, num_decodes) and a prefill (varlen) kernel
the rest. Host-side copies of the lengths let the CPU path and kernel launch grids avoid a
device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: where each sequence's query tokens start
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: logical → physical block
    slot_mapping: (
        torch.Tensor
    )  # int64 [num_tokens]: cache slot (block * block_size + offset); -1 = skip
    num_decodes: int  # leading sequences with one query token each
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Step scratch for the CPU path: the additive mask of each prefill over cached context, by
    # sequence index. The first layer builds it and the others reuse it (building it per layer,
    # and SDPA's bool-to-float conversion, cost a quarter of such a prefill's attention time).
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


@dataclass(slots=True)
class LoraMapping:
    """Which LoRA slot each of a step's tokens runs (`Kernels.add_lora`). The model runner
    orders a step's tokens so that each adapter's rows are runs of consecutive rows."""

    token_slots: torch.Tensor  # int64 [T] on the device: each token's slot, -1 for the base model
    # Host copy as runs of equal slots: (slot, first row, end row), base-model rows left out.
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def column_mask(self, slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots * rank]: 1 where the column belongs to the row's slot, else 0 (every
        column of a base-model row). Built once per step and shape, shared by all layers."""
        key = (slots, rank, dtype)
        mask = self._masks.get(key)
        if mask is None:
            owner = torch.arange(slots, device=self.token_slots.device).repeat_interleave(rank)
            mask = (self.token_slots[:, None] == owner[None, :]).to(dtype)
            self._masks[key] = mask
        return mask

"""The collectives a tensor-parallel model calls: the sum after each row-split projection and
the gather of vocabulary-split logits, over torch.distributed's default process group (gloo on
CPU, NCCL on CUDA: the same calls, the backend picked by device when the group is made).

Every op runs under the group's timeout (`init_process_group(timeout=...)`): a rank that died
or hangs turns into an exception on the others within it, never a wait for ever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from kvfleet.runtime.models.shard_layout import ShardLayout


class TPGroup:
    """This process's rank of the tensor-parallel group the model's collectives run over.
    Built before the process group exists (a rank loads its shard first); used after."""

    def __init__(self, layout: ShardLayout) -> None:
        self.layout = layout
        self.rank, self.size = layout.rank, layout.size
        self._sums_bf16: bool | None = None  # known once the process group exists
        ranges = layout.vocab_ranges()
        self._vocab_width = max(b - a for a, b in ranges)
        self._vocab_ranges = ranges

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (the partial outputs of a row-split projection)."""
        if self._sums_bf16 is None:
            # gloo sums float32 but not every build sums bfloat16; NCCL sums all of them.
            self._sums_bf16 = dist.get_backend() != "gloo"
        if x.dtype == torch.bfloat16 and not self._sums_bf16:
            wide = x.float()
            dist.all_reduce(wide)
            return wide.to(x.dtype)
        dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [rows, vocab] on rank 0 from every rank's vocabulary slice
        [rows, its vocab rows]; None on the other ranks (only rank 0 samples)."""
        rows = local.shape[0]
        if local.shape[1] != self._vocab_width:  # uneven split: pad to the widest slice
            padded = local.new_zeros(rows, self._vocab_width)
            padded[:, : local.shape[1]] = local
            local = padded
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0)
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(
            [p[:, : b - a] for p, (a, b) in zip(parts, self._vocab_ranges, strict=True)], 1
        )

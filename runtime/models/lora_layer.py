"""What one layer's forward needs to add a step's LoRA adapters to its projections."""

from __future__ import annotations

import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.metadata import LoraMapping


class LoraLayer:
    """One layer's adapter stacks (per fused projection: A [slots, r', in], B [slots, out, r'])
    and the step's token → slot mapping."""

    __slots__ = ("kernels", "mapping", "stacks")

    def __init__(
        self,
        kernels: dispatch.Kernels,
        mapping: LoraMapping,
        stacks: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.kernels, self.mapping, self.stacks = kernels, mapping, stacks

    def add(self, y: torch.Tensor, x: torch.Tensor, projection: str) -> None:
        """y += the step's adapters' delta of `projection` for input x. Rows of base-model
        tokens are left alone, and so are projections that no resident adapter targets (they
        are not in `stacks`): an adapter of q and v alone costs nothing in the MLP."""
        stack = self.stacks.get(projection)
        if stack is not None:
            self.kernels.add_lora(y, x, stack[0], stack[1], self.mapping)

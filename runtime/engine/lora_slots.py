"""The adapters the engine core knows, and the `max_loras` slots that hold them ready on the
model's device.

The model reads adapters from stacked tensors, one per fused projection and layer: A
[max_loras, slices * max_rank, in] and B [max_loras, out, slices * max_rank], slot s holding
one adapter (rank padded with zeros; q/k/v and gate/up side by side, each slice's B a block
of its own rows), so one gather-matmul serves every adapter of a step at once
(`Kernels.add_lora`). The scheduler lets at most `max_loras` adapters run at once, so the
adapters of a step always fit the slots; a slot is refilled only when a step needs an adapter
that is not resident (least recently used first), and an adapter's CPU copy is kept in an LRU
of `max_cpu_loras`, read again from its folder when evicted.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.kernels.metadata import LoraMapping
from kvfleet.runtime.models.config import ModelConfig
from kvfleet.runtime.models.lora import TARGETS, LoraAdapter, LoraError, load_lora_adapter
from kvfleet.runtime.models.lora_layer import LoraLayer

if TYPE_CHECKING:
    from kvfleet.runtime.engine.request import Request
    from kvfleet.runtime.engine.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger(__name__)

# Each fused projection's slices, in the order their outputs sit in it.
SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(slots=True)
class _Known:
    name: str
    path: str
    users: int = 0  # unfinished sequences that run it
    removed: bool = False  # unloaded: forgotten once its last sequence ends


class LoraSlots:
    """Known adapters by id (the server's numbering: never reused), their CPU copies and the
    device slots."""

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config, self.max_rank = config, max_rank
        self.max_loras, self.max_cpu_loras = max_loras, max(max_cpu_loras, max_loras)
        self.known: dict[int, _Known] = {}
        self.cpu: OrderedDict[int, LoraAdapter] = OrderedDict()  # LRU: front = evict first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident id → slot, LRU order
        self.targets = [dict.fromkeys(SLICES, 0) for _ in range(config.num_layers)]
        d, h, inter = config.head_dim, config.hidden_size, config.intermediate_size
        outs = {
            "qkv_proj": (config.num_heads + 2 * config.num_kv_heads) * d,
            "o_proj": h,
            "gate_up_proj": 2 * inter,
            "down_proj": h,
        }
        ins = {"qkv_proj": h, "o_proj": config.num_heads * d, "gate_up_proj": h, "down_proj": inter}

        def stack(projection: str) -> tuple[torch.Tensor, torch.Tensor]:
            width = len(SLICES[projection]) * max_rank
            a = torch.zeros(max_loras, width, ins[projection], dtype=dtype, device=device)
            # B held as one [out, slots * width] matrix (the CPU path multiplies by all of it
            # at once), seen by the kernels as [slots, out, width].
            b = torch.zeros(outs[projection], max_loras * width, dtype=dtype, device=device)
            return a, b.view(outs[projection], max_loras, width).permute(1, 0, 2)

        self.stacks = [{p: stack(p) for p in SLICES} for _ in range(config.num_layers)]
        self._slot_adapter: list[int | None] = [None] * max_loras
        # The (layer, projection) pairs each slot's adapter targets: `targets` counts them.
        self._slot_targets: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]
        # Where each module's outputs start in its fused projection.
        q, kv = config.num_heads * d, config.num_kv_heads * d
        self._out_offset = {
            "q_proj": 0,
            "k_proj": q,
            "v_proj": q + kv,
            "o_proj": 0,
            "gate_proj": 0,
            "up_proj": inter,
            "down_proj": 0,
        }

    # --- what the server asks ---------------------------------------------------------------
    def add(self, lora_id: int, name: str, path: str) -> None:
        """Load and check adapter `lora_id` (LoraError saying why it cannot run here)."""
        if lora_id in self.known and not self.known[lora_id].removed:
            raise LoraError(f"adapter {name!r}: id {lora_id} is already loaded")
        adapter = load_lora_adapter(name, path, self.config, self.max_rank)
        self.known[lora_id] = _Known(name, path)
        self._keep_cpu(lora_id, adapter)
        log.info(
            "LoRA adapter %r loaded from %s: rank %d on %s, %.1f MB",
            name,
            path,
            adapter.rank,
            ", ".join(sorted(adapter.modules)),
            adapter.nbytes / 1e6,
        )

    def remove(self, lora_id: int) -> None:
        """Forget an adapter once no unfinished sequence runs it."""
        known = self.known.get(lora_id)
        if known is not None:
            known.removed = True
            self._forget_if_unused(lora_id)

    def name_of(self, lora_id: int) -> str | None:
        known = self.known.get(lora_id)
        return known.name if known is not None else None

    def retain(self, lora_id: int) -> None:
        """A sequence that runs the adapter was added (LoraError if it is not known)."""
        known = self.known.get(lora_id)
        if known is None or known.removed:
            raise LoraError(f"LoRA adapter id {lora_id} is not loaded (unloaded meanwhile?)")
        known.users += 1

    def release(self, lora_id: int) -> None:
        known = self.known.get(lora_id)
        if known is not None:
            known.users -= 1
            self._forget_if_unused(lora_id)

    def names_in_use(
        self, scheduler: Scheduler, compiling: Iterable[Request]
    ) -> dict[str, list[str]]:
        """The names of the adapters running and waiting sequences run, as EngineStats'
        lora_running and lora_waiting."""
        waiting = itertools.chain(scheduler.waiting, compiling)
        return {
            "lora_running": self._names(scheduler.running),
            "lora_waiting": self._names(waiting),
        }

    def _names(self, requests: Iterable[Request]) -> list[str]:
        ids = {r.lora_id for r in requests if r.lora_id}
        return sorted(self.known[i].name for i in ids if i in self.known)

    # --- what a step asks ----------------------------------------------------------------------
    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Slots of the step's adapters (at most max_loras: the scheduler's promise), filling
        slots of adapters the step does not use, least recently used first."""
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"{len(lora_ids)} adapters in one step, more than {self.max_loras}")
        for lora_id in lora_ids:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id in lora_ids:
            if lora_id not in self.slot_of:
                self._fill(self._free_slot(lora_ids), lora_id)
        return {lora_id: self.slot_of[lora_id] for lora_id in lora_ids}

    def make_resident(self, batch: ScheduledBatch) -> list[tuple[Request, LoraError]]:
        """Bring a scheduled step's adapters into slots before it runs. An adapter that must be
        read again and no longer can be (its folder changed or gone since it was loaded) takes
        its requests out of the batch, each with the error to fail it with: that request
        fails, not the step."""
        ids = {r.lora_id for r in batch.requests if r.lora_id}
        unreadable: dict[int, LoraError] = {}
        for lora_id in sorted(ids):
            try:
                self.activate({lora_id} | (ids - unreadable.keys()) & self.slot_of.keys())
            except LoraError as exc:
                unreadable[lora_id] = exc
        failed = [(r, unreadable[r.lora_id]) for r in batch.requests if r.lora_id in unreadable]
        for i in range(len(batch.requests) - 1, -1, -1):
            if batch.requests[i].lora_id in unreadable:
                del batch.requests[i]
                del batch.num_tokens[i]
        return failed

    def layers(self, kernels, mapping: LoraMapping) -> list[LoraLayer]:
        """Each layer's view for one step: only the projections some resident adapter
        targets, so an adapter of q and v alone costs nothing on the MLP."""
        return [
            LoraLayer(kernels, mapping, {p: s for p, s in stacks.items() if targets[p]})
            for stacks, targets in zip(self.stacks, self.targets, strict=True)
        ]

    # --- internals ---------------------------------------------------------------------------
    def _free_slot(self, keep: set[int]) -> int:
        if None in self._slot_adapter:
            return self._slot_adapter.index(None)
        for lora_id, slot in self.slot_of.items():  # least recently used first
            if lora_id not in keep:
                self._clear(slot)
                return slot
        raise ValueError("no LoRA slot is free")

    def _fill(self, slot: int, lora_id: int) -> None:
        adapter = self.cpu.get(lora_id)
        if adapter is None:  # evicted from memory: read it again
            known = self.known[lora_id]
            adapter = load_lora_adapter(known.name, known.path, self.config, self.max_rank)
            self._keep_cpu(lora_id, adapter)
        self.cpu.move_to_end(lora_id)
        r = self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            projection, index = TARGETS[module]
            a_stack, b_stack = self.stacks[layer][projection]
            rank = a.shape[0]
            cols = slice(index * r, index * r + rank)
            out = slice(self._out_offset[module], self._out_offset[module] + b.shape[0])
            a_stack[slot, cols].copy_(a)
            b_stack[slot, out, cols].copy_(b)
            if (layer, projection) not in self._slot_targets[slot]:
                self._slot_targets[slot].add((layer, projection))
                self.targets[layer][projection] += 1
        self._slot_adapter[slot] = lora_id
        self.slot_of[lora_id] = slot

    def _clear(self, slot: int) -> None:
        for layer, projection in self._slot_targets[slot]:
            self.targets[layer][projection] -= 1
        self._slot_targets[slot] = set()
        for stacks in self.stacks:
            for a_stack, b_stack in stacks.values():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
        self.slot_of.pop(self._slot_adapter[slot], None)
        self._slot_adapter[slot] = None

    def _keep_cpu(self, lora_id: int, adapter: LoraAdapter) -> None:
        # A resident adapter's CPU copy may go too: the slot holds what the steps read.
        self.cpu[lora_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _drop_cpu(self, lora_id: int) -> None:
        if lora_id in self.slot_of:
            self._clear(self.slot_of[lora_id])
        self.cpu.pop(lora_id, None)

    def _forget_if_unused(self, lora_id: int) -> None:
        known = self.known[lora_id]
        if known.removed and known.users <= 0:
            self._drop_cpu(lora_id)
            del self.known[lora_id]

"""LoRA decisions without a model: the scheduler never runs more adapters at once than the
slots hold and still finishes every request (no block leak), the prefix cache keeps each
adapter's blocks apart, and the slots hold exactly the adapters a step needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.lora_slots import LoraSlots
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.runtime.models.loader import load_config
from kvfleet.runtime.models.lora import load_lora_adapter


def _request(rid: str, prompt: list[int], max_tokens: int, lora_id: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, frozenset({0}), max_tokens, lora_id=lora_id)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_loras=st.integers(1, 3),
    max_num_seqs=st.integers(1, 6),
    arrivals=st.lists(
        st.tuples(st.integers(0, 10), st.integers(0, 5), st.integers(1, 20), st.integers(1, 8)),
        min_size=1,
        max_size=14,
    ),
)
def test_at_most_max_loras_adapters_run_and_every_request_finishes(
    max_loras: int, max_num_seqs: int, arrivals: list[tuple[int, int, int, int]]
) -> None:
    kv = KVCacheManager(num_blocks=24, block_size=4)
    config = SchedulerConfig(max_num_seqs, 32, max_loras=max_loras)
    sched = Scheduler(config, kv)
    added: list[Request] = []
    for step in range(2000):
        for i, (at, lora, length, max_tokens) in enumerate(arrivals):
            if at == step:
                # Prompts that share a prefix across adapters: only same-adapter hits allowed.
                r = _request(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8][:length] + [9] * (length - 8),
                             max_tokens, lora)  # fmt: skip
                added.append(r)
                sched.add(r)
        batch = sched.schedule()
        running = {r.lora_id for r in sched.running if r.lora_id}
        assert len(running) <= max_loras
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(5)
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish(r, "length")
        # A shared block is only ever shared by requests of one adapter.
        owners: dict[int, set[int]] = {}
        for rid, blocks in kv.req_blocks.items():
            for b in blocks:
                owners.setdefault(b, set()).add(sched.requests[rid].lora_id)
        assert all(len(ids) == 1 for ids in owners.values())
        if step > 10 and not sched.has_unfinished():
            break
    assert all(r.finished and r.finish_reason == "length" for r in added)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_waiting_request_of_another_adapter_lets_the_base_model_pass() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(8, 64, max_loras=1), kv)
    first, blocked, base = (
        _request("a", [1, 2, 3], 5, 1),
        _request("b", [4, 5, 6], 5, 2),
        _request("c", [7, 8, 9], 5, 0),
    )
    for r in (first, blocked, base):
        sched.add(r)
    assert [r.request_id for r in sched.schedule().requests] == ["a", "c"]
    assert [r.request_id for r in sched.waiting] == ["b"]  # first in line for the slot
    sched.finish(first, "length")
    assert "b" in [r.request_id for r in sched.schedule().requests]


@pytest.fixture
def slots(tiny_llama_dir: Path) -> LoraSlots:
    return LoraSlots(load_config(tiny_llama_dir), 2, 16, 2, torch.float32, torch.device("cpu"))


def _stacked_delta(slots: LoraSlots, slot: int, layer: int, module: str) -> torch.Tensor:
    """What slot `slot` adds to `module`'s output rows for an identity input (B @ A)."""
    projection = {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj", "down_proj": "down_proj"}
    a, b = slots.stacks[layer][projection[module]]
    return b[slot] @ a[slot]


def test_slots_refill_least_recently_used_and_reread_evicted_adapters(
    slots, tiny_llama_dir, tiny_lora_dirs
):
    config = load_config(tiny_llama_dir)
    for i, path in enumerate(tiny_lora_dirs[:3]):
        slots.add(i + 1, path.name, str(path))
    assert list(slots.cpu) == [2, 3]  # max_cpu_loras 2: the first was let go
    assert slots.activate({1, 2}) == {1: 0, 2: 1}  # adapter 1 read again from its folder
    slots.activate({2})
    assert slots.activate({3}) == {3: 0}  # adapter 1 was the least recently used
    adapter = load_lora_adapter("x", tiny_lora_dirs[2], config, 16)
    a, b = adapter.weights[(1, "down_proj")]
    torch.testing.assert_close(_stacked_delta(slots, 0, 1, "down_proj"), b @ a)
    # Adapter 3 targets the MLP only: slot 0's attention rows were cleared, not left over.
    assert torch.count_nonzero(slots.stacks[0]["qkv_proj"][0][0]) == 0
    # Resident now: adapter 3 (MLP) and adapter 2 (q and v): o_proj is skipped altogether.
    assert slots.targets[0] == {"qkv_proj": 1, "o_proj": 0, "gate_up_proj": 1, "down_proj": 1}
    assert "o_proj" not in slots.layers(None, None)[0].stacks  # type: ignore[arg-type]


def test_an_unloaded_adapter_stays_until_its_last_sequence_ends(slots, tiny_lora_dirs):
    slots.add(1, "a", str(tiny_lora_dirs[0]))
    slots.retain(1)
    slots.remove(1)
    assert slots.name_of(1) == "a"
    slots.activate({1})
    slots.release(1)
    assert slots.name_of(1) is None and not slots.slot_of and not slots.cpu
    with pytest.raises(ValueError, match="id 1 is not loaded"):
        slots.retain(1)

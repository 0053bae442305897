"""How waiting prompts share steps with running decodes (issue 22): oldest first, decodes never
held back by prefills, a long prompt's chunk per step capped by --long-prefill-token-threshold,
and no prompt delayed without bound by prompts that arrived after it. Driven without a model,
as in test_scheduler_properties.py: a step "computes" what was scheduled and a request whose
known tokens are all computed samples one."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig

EOS = frozenset({0})


def _request(rid: str, prompt_len: int, max_tokens: int, arrival: float) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # Distinct tokens per request: no prefix hits, so "other things equal" holds.
    base = 1000 * (int(rid.removeprefix("r")) + 1)
    prompt = [base + i % 997 for i in range(prompt_len)]
    return Request(rid, prompt, params, EOS, max_tokens, arrival_time=arrival)


class Run:
    """Steps a scheduler over timed arrivals; records each request's first-token step and every
    step's batch."""

    def __init__(self, config: SchedulerConfig, num_blocks: int = 4096, block_size: int = 16):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sched = Scheduler(config, self.kv)
        self.arrived: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.batches: list[ScheduledBatch] = []
        # Per step: the running requests that had only their next token to compute.
        self.decode_ready: list[list[str]] = []
        self.step_no = 0

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> Request:
        r = _request(rid, prompt_len, max_tokens, arrival=float(self.step_no))
        self.arrived[rid] = self.step_no
        self.sched.add(r)
        return r

    def step(self) -> ScheduledBatch:
        self.decode_ready.append(
            [r.request_id for r in self.sched.running if r.num_tokens - r.num_computed_tokens == 1]
        )
        batch = self.sched.schedule()
        self.batches.append(batch)
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(7)
                self.first_token.setdefault(r.request_id, self.step_no)
                if r.num_output_tokens >= r.max_tokens:
                    self.sched.finish(r, "length")
        self.step_no += 1
        return batch


def _scheduled(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_tokens, strict=True)}


# --- the rules a user would recognise ----------------------------------------------------------
def test_a_prompt_that_arrived_first_gets_its_first_token_first() -> None:
    run = Run(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    for i in range(6):
        run.add(f"r{i}", 300, 4)  # 1800 tokens of prompts at once: four steps of prefill
    while len(run.first_token) < 6:
        run.step()
    order = sorted(run.first_token, key=lambda rid: (run.first_token[rid], rid))
    assert order == [f"r{i}" for i in range(6)]
    assert [run.first_token[f"r{i}"] for i in range(6)] == sorted(run.first_token.values())


def test_running_decodes_get_a_token_every_step_while_prompts_prefill() -> None:
    # A cap below the budget lets several prompts be part-way through prefill at once, and
    # together they could fill every step; the request whose prompt is done still decodes in
    # every step, and the prompts share what the decodes leave.
    run = Run(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, long_prefill_token_threshold=50)
    )
    run.add("r0", 1000, 4)
    run.add("r1", 20, 30)
    run.add("r2", 1000, 4)
    assert _scheduled(run.step()) == {"r0": 50, "r1": 20, "r2": 30}
    assert run.first_token == {"r1": 0}
    for _ in range(10):
        assert _scheduled(run.step()) == {"r1": 1, "r0": 50, "r2": 49}


def test_long_prefill_threshold_caps_each_prompt_chunk_and_lets_short_prompts_in() -> None:
    run = Run(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=128
        )
    )
    run.add("r0", 2048, 4)
    run.add("r1", 2048, 4)
    first = run.step()
    assert _scheduled(first) == {"r0": 128, "r1": 128}  # the rest of the budget is unused
    run.add("r2", 40, 4)
    second = run.step()
    # The short prompt that arrived behind two long ones is prefilled in the next step.
    assert _scheduled(second) == {"r0": 128, "r1": 128, "r2": 40}
    assert run.first_token["r2"] == 1


def test_without_a_threshold_a_prompt_takes_the_whole_budget() -> None:
    run = Run(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    run.add("r0", 2048, 4)
    run.add("r1", 40, 4)
    assert _scheduled(run.step()) == {"r0": 512}
    assert _scheduled(run.step()) == {"r0": 512}


def test_an_old_prompt_is_not_starved_by_a_flood_of_short_new_ones() -> None:
    # A new short prompt every step, forever, more than the budget could serve with the old
    # one: the old long prompt still gets the oldest-first share of every step.
    run = Run(
        SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=256, long_prefill_token_threshold=128
        )
    )
    run.add("r0", 1024, 2)
    for i in range(1, 40):
        run.add(f"r{i}", 200, 2)
        run.step()
        if "r0" in run.first_token:
            break
    assert run.first_token["r0"] == math.ceil(1024 / 128) - 1  # 8 steps: no delay at all


def test_a_preempted_request_goes_before_prompts_that_arrived_after_it() -> None:
    run = Run(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), num_blocks=4, block_size=2
    )
    old = run.add("r0", 4, 4)
    new = run.add("r1", 4, 4)
    run.step()  # both prefilled: the pool (4 blocks of 2) is full
    later = run.add("r2", 2, 2)
    batch = run.step()  # both need a third block: the newest yields
    assert [r.request_id for r in batch.preempted] == ["r1"]
    assert list(run.sched.waiting) == [new, later]
    assert old.request_id in _scheduled(batch)


# --- invariants over random arrivals -----------------------------------------------------------
@st.composite
def arrivals(draw: st.DrawFn) -> dict:
    budget = draw(st.integers(16, 512))
    max_num_seqs = draw(st.integers(1, 12))
    threshold = draw(st.sampled_from([0, 0, 8, 32, 100, 1000]))
    reqs = [
        (draw(st.integers(0, 20)), draw(st.integers(1, 600)), draw(st.integers(1, 12)))
        for _ in range(draw(st.integers(1, 14)))
    ]
    reqs.sort(key=lambda t: t[0])
    return {
        "config": SchedulerConfig(max_num_seqs, budget, True, threshold),
        "requests": reqs,
        # Small pools force waiting for blocks and preemption; large ones never do.
        "num_blocks": draw(st.sampled_from([40, 80, 4096])),
    }


def _drive(s: dict, block_size: int = 16) -> Run:
    run = Run(s["config"], num_blocks=s["num_blocks"], block_size=block_size)
    for _ in range(5000):
        for i, (at, plen, out) in enumerate(s["requests"]):
            if at == run.step_no and plen + out <= s["num_blocks"] * block_size:
                run.add(f"r{i}", plen, out)
        run.step()
        if run.step_no > 20 and not run.sched.has_unfinished():
            return run
    raise AssertionError("a request never finished")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals())
def test_earlier_arrival_and_no_longer_prompt_means_first_token_no_later(s: dict) -> None:
    run = _drive(s)
    reqs = {f"r{i}": t for i, t in enumerate(s["requests"]) if f"r{i}" in run.arrived}
    for a, (at_a, len_a, _) in reqs.items():
        for b, (at_b, len_b, _) in reqs.items():
            if (at_a, int(a[1:])) < (at_b, int(b[1:])) and len_a <= len_b:
                assert run.first_token[a] <= run.first_token[b], (a, b)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals())
def test_decodes_are_never_skipped_for_prefills_and_chunks_respect_the_threshold(s: dict) -> None:
    cfg: SchedulerConfig = s["config"]
    run = _drive(s)
    for step, batch in enumerate(run.batches):
        sched = _scheduled(batch)
        assert batch.total_tokens <= cfg.max_num_batched_tokens
        prefill = {rid: n for rid, n in sched.items() if n > 1}
        if cfg.long_prefill_token_threshold:
            assert all(n <= cfg.long_prefill_token_threshold for n in prefill.values())
        if batch.preempted or cfg.max_num_batched_tokens < cfg.max_num_seqs:
            continue  # memory pressure decides by age; a budget below the seats cannot
        for rid in run.decode_ready[step]:
            assert sched.get(rid) == 1, f"step {step}: {rid} held back by {prefill}"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals())
def test_no_prompt_waits_longer_than_the_work_that_arrived_before_it(s: dict) -> None:
    """With room in the cache, a prompt's wait depends only on the requests that arrived no
    later than it, whatever arrives after: each step the oldest unfinished of those makes
    progress (a decode token, or at least min(threshold, budget - other decodes) prompt
    tokens), so the wait is at most the steps they take one after another."""
    cfg: SchedulerConfig = s["config"]
    if s["num_blocks"] != 4096 or cfg.max_num_batched_tokens < cfg.max_num_seqs:
        return
    run = _drive(s)
    share = cfg.max_num_batched_tokens - cfg.max_num_seqs + 1
    if cfg.long_prefill_token_threshold:
        share = min(share, cfg.long_prefill_token_threshold)
    for i, (at, plen, _out) in enumerate(s["requests"]):
        ahead = sum(math.ceil(pl / share) + o - 1 for pl, o in (t[1:] for t in s["requests"][:i]))
        bound = ahead + math.ceil(plen / share) - 1
        assert run.first_token[f"r{i}"] - at <= bound, (f"r{i}", bound)


# --- the flag ----------------------------------------------------------------------------------
def test_threshold_is_validated_with_the_field_name() -> None:
    with pytest.raises(ConfigError, match="long_prefill_token_threshold: must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)
    assert EngineConfig().long_prefill_token_threshold == 0


def test_threshold_flag_reaches_the_scheduler_and_changes_no_output() -> None:
    import argparse

    from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
    from kvfleet.runtime.engine.llm import LLM

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--long-prefill-token-threshold", "256"])
    assert engine_config_from_args(args).long_prefill_token_threshold == 256

    prompts = [[5 + i % 90 for i in range(n)] for n in (70, 9, 33)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM("random:tiny", kv_cache_memory="64MiB", max_num_batched_tokens=64)
    capped = LLM(
        "random:tiny",
        kv_cache_memory="64MiB",
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    )
    assert capped.engine.scheduler.config.long_prefill_token_threshold == 16
    # Prompts computed 16 tokens a step, interleaved with each other, give the same tokens.
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in capped.generate(prompts, params)] == want
    assert capped.engine.counters.steps > plain.engine.counters.steps

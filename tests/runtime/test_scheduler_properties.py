"""Property tests of the KV cache manager and the scheduler, driven without a model: random
arrivals, prompt lengths, shared prefixes, aborts and memory pressure. After every step the
books must balance; at the end every request is accounted for and every block is free."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request, RequestStatus
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig

EOS = frozenset({0})


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, EOS, max_tokens)


def _check_books(kv: KVCacheManager, sched: Scheduler) -> None:
    holders: Counter[int] = Counter()
    for rid, blocks in kv.req_blocks.items():
        assert len(blocks) == len(set(blocks)), f"{rid} holds a block twice"
        holders.update(blocks)
    for b in range(kv.num_blocks):
        assert kv.ref_counts[b] == holders[b], f"block {b}: refcount {kv.ref_counts[b]}"
        assert (kv.ref_counts[b] == 0) == (b in kv.free_queue)
    # A block held by two requests must be a published prefix block of both.
    for b, n in holders.items():
        if n > 1:
            h = kv.block_hash[b]
            assert h is not None and kv.cached.get(h) == b
            for rid, blocks in kv.req_blocks.items():
                if b in blocks:
                    req = sched.requests[rid]
                    i = blocks.index(b)
                    assert i < len(req.block_hashes) and req.block_hashes[i] == h
    live = {r.request_id for r in sched.running}
    assert set(kv.req_blocks) <= live | {r.request_id for r in sched.waiting}
    assert len(sched.running) <= sched.config.max_num_seqs


@st.composite
def scenario(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([2, 4, 8, 16]))
    num_blocks = draw(st.integers(3, 40))
    max_len = num_blocks * block_size  # every request must fit the pool alone
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_len, max_len + 8))
    prefixes = [
        draw(st.lists(st.integers(1, 5), min_size=0, max_size=3 * block_size)) for _ in range(2)
    ]
    arrivals = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(1, 50), min_size=1, max_size=max_len))
        prompt = (prefix + tail)[: max_len - 1]
        max_tokens = draw(st.integers(1, max_len - len(prompt)))
        arrivals.append((draw(st.integers(0, 15)), prompt, max_tokens))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 11)), max_size=4))
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "prefix_caching": draw(st.booleans()),
        "config": SchedulerConfig(draw(st.integers(1, 6)), budget, chunked),
        "arrivals": arrivals,
        "aborts": aborts,
    }


# Found by hypothesis: 3001 tokens of work behind max_num_seqs=1 outran a fixed 3000-step loop.
SEQUENTIAL_LONG_RUN = {
    "block_size": 16,
    "num_blocks": 30,
    "prefix_caching": False,
    "config": SchedulerConfig(1, 480, False),
    "arrivals": [(0, [1], n) for n in (255, 472, 58, 1, 1, 299, 274, 395, 357, 400, 374, 115)],
    "aborts": [],
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
@example(SEQUENTIAL_LONG_RUN)
def test_no_leak_no_double_allocation_within_budgets_nothing_lost(s: dict) -> None:
    kv = KVCacheManager(s["num_blocks"], s["block_size"], s["prefix_caching"])
    sched = Scheduler(s["config"], kv)
    added: dict[str, Request] = {}
    # Room for every request to run alone, one token a step, and be recomputed after
    # preemption: 12 requests of up to 480 tokens behind max_num_seqs=1 need over 3000 steps.
    work = sum(len(prompt) + max_tokens for _, prompt, max_tokens in s["arrivals"])
    for step in range(max(3000, 16 + 4 * work)):
        for i, (at, prompt, max_tokens) in enumerate(s["arrivals"]):
            if at == step:
                r = _request(f"r{i}", prompt, max_tokens)
                added[r.request_id] = r
                sched.add(r)
        for at, which in s["aborts"]:
            if at == step and f"r{which}" in added:
                sched.abort(f"r{which}")
        batch = sched.schedule()
        assert batch.total_tokens <= s["config"].max_num_batched_tokens
        assert len(batch.requests) <= s["config"].max_num_seqs
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            assert n >= 1
            assert r.status is RequestStatus.RUNNING
            # The blocks cover everything computed so far plus this step's tokens.
            assert len(kv.blocks_of(r.request_id)) * kv.block_size >= r.num_computed_tokens + n
        _check_books(kv, sched)
        # "Execute": tokens computed; a request whose known tokens are all computed samples one.
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(7 + r.num_tokens % 3)
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish(r, "length")
        _check_books(kv, sched)
        if step > 15 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "a request never finished (livelock or lost)"
    for r in added.values():
        assert r.finished
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens
        else:
            assert r.finish_reason == "abort"
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert all(c == 0 for c in kv.ref_counts)


def test_prefix_hit_shares_blocks_and_counts_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    blocks, n = kv.get_computed_blocks(a)
    assert (blocks, n) == ([], 0)
    assert kv.allocate_slots(a, 9, blocks)
    b = _request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], 1)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and blocks == kv.blocks_of("a")[:2]
    assert kv.allocate_slots(b, 2, blocks)
    assert kv.ref_counts[blocks[0]] == 2
    assert kv.stats.hits == 8 and kv.stats.queries == 19


def test_a_request_waiting_for_blocks_counts_its_prefix_lookup_once() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    big = _request("big", [1, 2, 3, 4, 5, 6, 7], 1)  # four blocks: the whole pool
    sched.add(big)
    sched.schedule()
    big.num_computed_tokens = 7
    late = _request("late", [1, 2, 3, 4, 8], 1)
    sched.add(late)
    for _ in range(5):  # no room: it waits, looked up at every step
        assert [r.request_id for r in sched.schedule().requests] == ["big"]
    assert (kv.stats.queries, kv.stats.hits) == (7, 0)
    sched.finish(big, "length")
    assert [r.request_id for r in sched.schedule().requests] == ["late"]
    assert (kv.stats.queries, kv.stats.hits) == (7 + 5, 4)  # its two cached blocks, once


def test_freed_prefix_blocks_are_reused_lru_and_evicted_only_when_needed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5], 1)
    kv.allocate_slots(a, 5)
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.cached) == 2  # contents kept
    b = _request("b", [1, 2, 3, 4, 9], 1)
    _blocks, n = kv.get_computed_blocks(b)
    assert n == 4
    kv.free(b)
    c = _request("c", [7] * 7, 1)  # needs all 4 blocks: evicts the cached ones
    assert kv.allocate_slots(c, 7)
    assert kv.cached == {} or all(kv.ref_counts[b] == 1 for b in kv.cached.values())


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(1, 9)), 1)
    kv.allocate_slots(a, 8)
    b = _request("b", list(range(1, 9)), 1)
    _blocks, n = kv.get_computed_blocks(b)
    assert n == 4  # 8 tokens cached, but one must be computed to get logits: back off a block


def test_preemption_picks_the_newest_and_loses_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    old = _request("old", [1, 2, 3, 4], 4)  # two blocks each: the pool is full
    new = _request("new", [5, 6, 7, 8], 4)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["old", "new"]
    for r, n in zip(batch.requests, batch.num_tokens, strict=True):
        r.num_computed_tokens += n
        r.all_token_ids.append(9)
    # Both now need a third block and none is free: the newest yields its two.
    batch = sched.schedule()
    assert [r.request_id for r in batch.preempted] == ["new"]
    assert sched.num_preemptions == 1
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.all_token_ids == [5, 6, 7, 8, 9]  # its generated token is kept for the recompute
    assert sched.waiting[0] is new
    assert [r.request_id for r in batch.requests] == ["old"]

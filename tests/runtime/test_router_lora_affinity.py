"""The router's LoRA adapter affinity: a request whose model names an adapter goes to a replica
that has it loaded (the others would answer 404), with prefix affinity and the balance bound
applied among those; base-model requests are placed as before. As a pure function, then over
HTTP with fake replicas reporting their adapters on /metrics."""

from __future__ import annotations

import json
import random

import aiohttp
from fake_replica import FakeReplica
from kvfleet.runtime.router import rendezvous
from kvfleet.runtime.router.policy import (
    AFFINITY,
    FALLBACK_OVERLOADED,
    LEAST_LOADED,
    Placement,
    PolicySettings,
    ReplicaView,
    adapter_replicas,
    pick_replica,
)
from test_router_http import post, router_over, wait_until

from kvfleet.runtime_load import parse_runtime_metrics

PREFIX = PolicySettings()
KEYS = [f"sql\x00schema {i}".encode() for i in range(200)]
SQL = frozenset({"sql"})


def fleet(with_sql: str = "bc", **load: dict[str, float]) -> list[ReplicaView]:
    return [
        ReplicaView(n, adapters=SQL if n in with_sql else frozenset(), **load.get(n, {}))
        for n in "abcd"
    ]


def test_an_adapters_requests_go_only_to_replicas_that_have_it():
    picks = {pick_replica(fleet(), k, PREFIX, model="sql").name for k in KEYS}
    assert picks == {"b", "c"}  # spread over both, by prefix
    # Within them, a prefix keeps to its replica: the rendezvous ranking over b and c alone.
    for key in KEYS[:20]:
        pick = pick_replica(fleet(), key, PREFIX, model="sql")
        assert (pick.name, pick.reason) == (rendezvous.rank(key, ["b", "c"])[0], AFFINITY)


def test_base_model_requests_and_unknown_models_are_placed_as_before():
    plain = [ReplicaView(n) for n in "abcd"]
    for model in ("chat", None, "not-loaded-anywhere"):
        for key in KEYS[:50]:
            assert pick_replica(fleet(), key, PREFIX, model=model) == pick_replica(plain, key, PREFIX)  # fmt: skip


def test_an_overloaded_adapter_replica_spills_to_another_that_has_it_never_elsewhere():
    key = KEYS[0]
    first, second = rendezvous.rank(key, ["b", "c"])
    busy = fleet(**{first: {"waiting": 9.0}})
    pick = pick_replica(busy, key, PREFIX, model="sql")
    assert (pick.name, pick.reason) == (second, FALLBACK_OVERLOADED)
    # All of its replicas overloaded: the least loaded of them, though a and d idle.
    both = fleet(**{first: {"waiting": 9.0}, second: {"waiting": 6.0}})
    pick = pick_replica(both, key, PREFIX, model="sql")
    assert (pick.name, pick.reason) == (second, FALLBACK_OVERLOADED)


def test_the_balance_bound_counts_among_the_adapters_replicas():
    # b queues and has 5 in flight: over 1.5x the mean of b and c (cap 5), though far below
    # 1.5x the mean over all four replicas.
    key = next(k for k in KEYS if rendezvous.rank(k, ["b", "c"])[0] == "b")
    views = fleet(b={"waiting": 1.0, "in_flight": 5})
    assert pick_replica(views, key, PREFIX, model="sql").name == "c"


def test_with_a_placement_table_a_new_key_goes_to_the_adapters_replica_with_fewest_keys():
    counts = {"a": 0, "b": 3, "c": 1, "d": 0}
    pick = pick_replica(fleet(), KEYS[0], PREFIX, placement=Placement(None, counts), model="sql")
    assert (pick.name, pick.place) == ("c", True)
    # Placed on a replica that has since lost the adapter: placed afresh among those with it.
    pick = pick_replica(fleet(with_sql="c"), KEYS[0], PREFIX, placement=Placement("b", counts), model="sql")  # fmt: skip
    assert pick.name == "c"


def test_baselines_keep_to_the_adapters_replicas_and_none_healthy_falls_back_to_all():
    views = fleet()
    rng = random.Random(0)
    assert {pick_replica(views, k, PolicySettings("random"), rng=rng, model="sql").name for k in KEYS} == {"b", "c"}  # fmt: skip
    pick = pick_replica(views, None, PREFIX, model="sql")
    assert pick.reason == LEAST_LOADED and pick.name in "bc"
    down = [ReplicaView(v.name, healthy=v.name not in "bc", adapters=v.adapters) for v in views]
    assert {v.name for v in adapter_replicas(down, "sql")} == set("abcd")
    assert pick_replica(down, KEYS[0], PREFIX, model="sql").name in "ad"
    # Tried already (a refusal) counts as not healthy too.
    assert {v.name for v in adapter_replicas(views, "sql", exclude={"b", "c"})} == set("abcd")


def test_the_loaded_adapters_are_read_from_metrics():
    page = (
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:num_requests_running{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0\n'
        'kvfleet:lora_adapter_loaded{lora_name="sql"} 1\n'
        'kvfleet:lora_adapter_loaded{lora_name="docs"} 1\n'
        'kvfleet:lora_adapter_loaded{lora_name="gone"} 0\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1\n'
    )
    assert parse_runtime_metrics(page).adapters == {"sql", "docs"}
    assert parse_runtime_metrics(page.split("kvfleet:")[0]).adapters == frozenset()


async def served_by(s: aiohttp.ClientSession, url: str, model: str, prompt: str) -> str:
    status, raw = await post(s, f"{url}/v1/completions", {"model": model, "prompt": prompt})
    assert status == 200, raw
    return json.loads(raw)["served_by"]


async def test_over_http_each_adapter_is_served_where_it_is_loaded():
    a, b = FakeReplica("a"), FakeReplica("b", adapters={"sql"})
    c = FakeReplica("c", adapters={"docs"})
    async with router_over(a, b, c) as (url, router), aiohttp.ClientSession() as s:
        await wait_until(lambda: router.pool.get(b.url).adapters == {"sql"})
        for i in range(6):
            prompt = f"question {i} " * 20
            assert await served_by(s, url, "sql", prompt) == "b"
            assert await served_by(s, url, "docs", prompt) == "c"
        base = {await served_by(s, url, "m", f"{i} " * 40) for i in range(12)}
        assert base == {"a", "b", "c"}  # the model alone is everywhere
        # The adapter is loaded on a too (the operator's next pass): it joins at the next scrape.
        a.adapters.add("sql")
        await wait_until(lambda: "sql" in router.pool.get(a.url).adapters)
        assert {await served_by(s, url, "sql", f"{i} " * 40) for i in range(12)} == {"a", "b"}

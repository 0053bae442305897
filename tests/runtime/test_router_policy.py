"""The router's choice of replica, as a pure function: rendezvous hashing moves few keys when
the fleet changes, an overloaded or unhealthy affine replica is passed over, and requests
without a prefix go to the least-loaded replica."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from kvfleet.runtime.router import rendezvous
from kvfleet.runtime.router.policy import (
    AFFINITY,
    FALLBACK_OVERLOADED,
    FALLBACK_UNHEALTHY,
    LEAST_LOADED,
    RANDOM,
    PolicySettings,
    ReplicaView,
    pick_replica,
)

KEYS = [f"system prompt {i}".encode() for i in range(6000)]
PREFIX = PolicySettings()


def names(n: int) -> list[str]:
    return [f"http://10.0.0.{i}:8000" for i in range(1, n + 1)]


def owners(views: list[ReplicaView]) -> dict[bytes, str]:
    picks = {k: pick_replica(views, k, PREFIX) for k in KEYS}
    return {k: p.name for k, p in picks.items() if p is not None}


def test_keys_spread_evenly_over_the_replicas():
    counts = Counter(owners([ReplicaView(n) for n in names(4)]).values())
    assert len(counts) == 4
    for count in counts.values():
        assert abs(count - len(KEYS) / 4) < 0.1 * len(KEYS) / 4, counts


@pytest.mark.parametrize("n", [3, 5])
def test_removing_a_replica_moves_only_its_keys(n: int):
    before = owners([ReplicaView(x) for x in names(n)])
    gone = names(n)[1]
    # Down (unhealthy) or removed from the list altogether: the same keys move, the same way.
    down = owners([ReplicaView(x, healthy=x != gone) for x in names(n)])
    removed = owners([ReplicaView(x) for x in names(n) if x != gone])
    assert down == removed
    moved = {k for k in KEYS if before[k] != removed[k]}
    assert moved == {k for k in KEYS if before[k] == gone}
    assert abs(len(moved) / len(KEYS) - 1 / n) < 0.03
    # Each moved key goes to its runner-up, so a prefix stays together on one replica.
    for k in list(moved)[:200]:
        assert removed[k] == rendezvous.rank(k, names(n))[1]


@pytest.mark.parametrize("n", [2, 4])
def test_adding_a_replica_moves_about_one_in_n_plus_one_keys_all_to_it(n: int):
    before = owners([ReplicaView(x) for x in names(n)])
    after = owners([ReplicaView(x) for x in names(n + 1)])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert {after[k] for k in moved} == {names(n + 1)[-1]}
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.03


def test_the_ranking_is_stable_across_processes_and_orders():
    key = b"model\x00You are a helpful assistant."
    a = rendezvous.rank(key, names(4))
    assert rendezvous.rank(key, list(reversed(names(4)))) == a
    # BLAKE2b, not Python's salted hash(): a restarted router ranks the same way.
    assert rendezvous.score(key, names(4)[0]) == rendezvous.score(key, names(4)[0])
    assert rendezvous.score(key, "a") != rendezvous.score(key, "b")


def affine_case() -> tuple[bytes, list[str]]:
    key = b"fake\x00a shared system prompt"
    return key, rendezvous.rank(key, names(3))


def test_the_affine_replica_gets_the_request_while_it_is_not_overloaded():
    key, ranked = affine_case()
    views = [ReplicaView(n, waiting=2, running=2, kv_usage=0.5) for n in names(3)]
    assert pick_replica(views, key, PREFIX).name == ranked[0]
    assert pick_replica(views, key, PREFIX).reason == AFFINITY


@pytest.mark.parametrize(
    "overload",
    [
        {"waiting": 5.0},  # more queued than max_waiting (4)
        {"kv_usage": 0.95},  # cache past max_kv_usage (0.9)
        {"in_flight": 6, "waiting": 1.0},  # queueing, over load_factor x the mean load
    ],
)
def test_an_overloaded_affine_replica_spills_to_the_next_in_the_keys_ranking(overload):
    key, ranked = affine_case()
    views = [ReplicaView(n, **(overload if n == ranked[0] else {})) for n in names(3)]
    pick = pick_replica(views, key, PREFIX)
    assert (pick.name, pick.reason) == (ranked[1], FALLBACK_OVERLOADED)


def test_a_replica_above_the_mean_load_that_queues_nothing_keeps_its_prefix():
    # It runs the request in the batch it already runs; elsewhere the prefix is prefilled again.
    key, ranked = affine_case()
    views = [ReplicaView(n, in_flight=6 if n == ranked[0] else 0) for n in names(3)]
    pick = pick_replica(views, key, PREFIX)
    assert (pick.name, pick.reason) == (ranked[0], AFFINITY)


def test_when_every_replica_is_overloaded_the_least_loaded_one_is_picked():
    key, ranked = affine_case()
    load = {ranked[0]: 9.0, ranked[1]: 7.0, ranked[2]: 6.0}
    views = [ReplicaView(n, waiting=load[n], running=4) for n in names(3)]
    pick = pick_replica(views, key, PREFIX)
    assert (pick.name, pick.reason) == (ranked[2], FALLBACK_OVERLOADED)


def test_an_unhealthy_replica_is_skipped_and_excluded_ones_too():
    key, ranked = affine_case()
    views = [ReplicaView(n, healthy=n != ranked[0]) for n in names(3)]
    pick = pick_replica(views, key, PREFIX)
    assert (pick.name, pick.reason) == (ranked[1], FALLBACK_UNHEALTHY)
    assert pick_replica(views, key, PREFIX, exclude={ranked[1]}).name == ranked[2]
    assert pick_replica(views, key, PREFIX, exclude=set(ranked[1:])) is None
    assert pick_replica([ReplicaView(n, healthy=False) for n in names(3)], key, PREFIX) is None


def test_without_a_prefix_the_least_loaded_replica_is_picked():
    views = [
        ReplicaView("a", running=3, in_flight=1),
        ReplicaView("b", running=1, in_flight=2),  # our count is fresher than its scrape
        ReplicaView("c", running=1, in_flight=1, kv_usage=0.2),
        ReplicaView("d", running=1, in_flight=1, kv_usage=0.1),
        ReplicaView("e", healthy=False),
    ]
    pick = pick_replica(views, None, PREFIX)
    assert (pick.name, pick.reason) == ("d", LEAST_LOADED)
    assert pick_replica(views, b"key", PolicySettings("least-loaded")).name == "d"


def test_the_random_baseline_ignores_the_key_and_unhealthy_replicas():
    views = [ReplicaView(n, healthy=n != names(4)[0]) for n in names(4)]
    rng = random.Random(0)
    picks = [
        pick_replica(views, b"same key", PolicySettings("random"), rng=rng) for _ in range(300)
    ]
    assert {p.reason for p in picks} == {RANDOM}
    assert Counter(p.name for p in picks).keys() == set(names(4)[1:])


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="policy"):
        PolicySettings("round-robin")
    with pytest.raises(ValueError, match="load_factor"):
        PolicySettings(load_factor=0.5)
    with pytest.raises(ValueError, match="max_kv_usage"):
        PolicySettings(max_kv_usage=0)

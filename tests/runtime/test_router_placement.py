"""Placement by table: the router remembers which replica each prefix key went to, sends it
back there, and places a new key where the fewest keys are, so a handful of system prompts
spread evenly (hashing alone put 8 keys over 3 replicas 4/3/1 or 5/2/1)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfleet.runtime.router import rendezvous
from kvfleet.runtime.router.placement import PlacementTable
from kvfleet.runtime.router.policy import (
    AFFINITY,
    FALLBACK_OVERLOADED,
    FALLBACK_UNHEALTHY,
    NEW_PREFIX,
    Placement,
    PolicySettings,
    ReplicaView,
    pick_replica,
)
from kvfleet.runtime.router.replica_pool import ReplicaPool

PREFIX = PolicySettings()


def names(n: int) -> list[str]:
    return [f"http://10.0.0.{i}:8000" for i in range(1, n + 1)]


def route(table: PlacementTable, views: list[ReplicaView], key: bytes, **kw):
    """What app.py does for one request: ask the policy with the table's view, record it."""
    pick = pick_replica(
        views, key, PREFIX, placement=Placement(table.owner(key), table.key_counts()), **kw
    )
    assert pick is not None
    if pick.place:
        table.assign(key, pick.name)
    else:
        table.touch(key)
    return pick


def system_prompts(n: int) -> list[bytes]:
    return [f"model\x00system prompt {i}".encode() for i in range(n)]


def test_8_keys_over_3_replicas_land_3_3_2():
    table, views = PlacementTable(), [ReplicaView(n) for n in names(3)]
    picks = [route(table, views, k) for k in system_prompts(8)]
    assert {p.reason for p in picks} == {NEW_PREFIX}
    assert sorted(Counter(p.name for p in picks).values()) == [2, 3, 3]
    assert sorted(table.key_counts().values()) == [2, 3, 3]


def test_hashing_alone_spreads_the_same_8_keys_worse():
    # Why the table exists: the same keys by rendezvous hashing, without it.
    spread = Counter(rendezvous.rank(k, names(3))[0] for k in system_prompts(8))
    assert max(spread.values()) >= 4


def test_a_known_key_sticks_to_its_replica_whatever_the_load_below_overload():
    table, keys = PlacementTable(), system_prompts(3)
    idle = [ReplicaView(n) for n in names(3)]
    first = {k: route(table, idle, k).name for k in keys}
    # Its replica now runs more than the others (but queues nothing): it still gets the key.
    for k in keys:
        busy = [ReplicaView(n, running=3 if n == first[k] else 0) for n in names(3)]
        pick = route(table, busy, k)
        assert (pick.name, pick.reason, pick.place) == (first[k], AFFINITY, False)


def test_a_new_key_goes_to_the_replica_with_the_fewest_keys_then_the_least_load():
    table = PlacementTable()
    table.assign(b"a", names(3)[0])
    table.assign(b"b", names(3)[1])
    views = [ReplicaView(n, running=2 if n == names(3)[2] else 0) for n in names(3)]
    assert route(table, views, b"new key").name == names(3)[2]  # fewest keys, though busiest
    views = [ReplicaView(n, running=0 if n == names(3)[1] else 1) for n in names(3)]
    assert route(table, views, b"another").name == names(3)[1]  # 1/1/1 keys: least load


def test_with_everything_equal_the_rendezvous_ranking_decides_so_routers_agree():
    for k in system_prompts(20):
        pick = pick_replica([ReplicaView(n) for n in names(3)], k, PREFIX, placement=Placement())
        assert pick.name == rendezvous.rank(k, names(3))[0]


def test_a_replica_leaving_moves_only_its_keys():
    pool = ReplicaPool(names(3), PlacementTable())
    keys = system_prompts(30)
    views = [ReplicaView(n) for n in names(3)]
    before = {k: route(pool.placement, views, k).name for k in keys}
    gone = names(3)[1]
    pool.set_upstreams([n for n in names(3) if n != gone])
    assert gone not in pool.placement.key_counts()
    views = [ReplicaView(n) for n in names(3) if n != gone]
    after = {k: route(pool.placement, views, k) for k in keys}
    for k in keys:
        if before[k] == gone:
            assert after[k].reason == NEW_PREFIX and after[k].name != gone
        else:
            assert (after[k].name, after[k].reason) == (before[k], AFFINITY)
    # Its 10 keys were placed afresh where the fewest were: 15/15 now.
    assert sorted(pool.placement.key_counts().values()) == [15, 15]


def test_a_down_replica_s_keys_are_placed_again_elsewhere():
    table, views = PlacementTable(), [ReplicaView(n) for n in names(3)]
    key = system_prompts(1)[0]
    owner = route(table, views, key).name
    down = [ReplicaView(n, healthy=n != owner) for n in names(3)]
    pick = route(table, down, key)
    assert pick.reason == FALLBACK_UNHEALTHY and pick.place and pick.name != owner
    assert table.owner(key) == pick.name


def test_a_replica_that_refused_the_request_keeps_its_key():
    # A 503 (queue full) is retried elsewhere, but the prefix stays cached where it was.
    table, views = PlacementTable(), [ReplicaView(n) for n in names(3)]
    key = system_prompts(1)[0]
    owner = route(table, views, key).name
    retry = route(table, views, key, exclude={owner})
    assert retry.name != owner and not retry.place
    assert table.owner(key) == owner


@pytest.mark.parametrize(
    "overload", [{"waiting": 5.0}, {"kv_usage": 0.95}, {"in_flight": 6, "waiting": 1.0}]
)
def test_an_overloaded_replica_s_new_keys_go_elsewhere(overload):
    table = PlacementTable()
    hot = names(3)[0]
    views = [ReplicaView(n, **(overload if n == hot else {})) for n in names(3)]
    picks = [route(table, views, k) for k in system_prompts(8)]
    assert hot not in {p.name for p in picks}
    assert sorted(table.key_counts().values()) == [4, 4]


def test_an_overloaded_owner_spills_its_request_but_keeps_its_key():
    table, views = PlacementTable(), [ReplicaView(n) for n in names(3)]
    key = system_prompts(1)[0]
    owner = route(table, views, key).name
    busy = [ReplicaView(n, waiting=5.0 if n == owner else 0) for n in names(3)]
    pick = route(table, busy, key)
    assert pick.reason == FALLBACK_OVERLOADED and pick.name != owner and not pick.place
    # Spilled to the next in the key's ranking, so it spills to one place each time.
    assert pick.name == next(n for n in rendezvous.rank(key, names(3)) if n != owner)
    assert route(table, views, key).name == owner


def test_the_table_forgets_the_least_recently_used_key_past_its_size():
    table = PlacementTable(max_keys=2)
    table.assign(b"a", "r1")
    table.assign(b"b", "r2")
    table.touch(b"a")
    table.assign(b"c", "r1")
    assert (table.owner(b"a"), table.owner(b"b"), table.owner(b"c")) == ("r1", None, "r1")
    assert dict(table.key_counts()) == {"r1": 2}
    table.assign(b"a", "r2")  # placed again: moves, counted once
    assert dict(table.key_counts()) == {"r1": 1, "r2": 1}
    with pytest.raises(ValueError, match="max_keys"):
        PlacementTable(0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=8),
    keys=st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=60, unique=True),
    repeats=st.lists(st.integers(min_value=0, max_value=59), max_size=60),
)
def test_keys_placed_on_equally_loaded_replicas_differ_by_at_most_one(n, keys, repeats):
    table, views = PlacementTable(), [ReplicaView(x) for x in names(n)]
    for i, k in enumerate(keys):
        route(table, views, k)
        # Known keys coming back move nothing.
        for r in repeats[:i]:
            if r < i:
                assert route(table, views, keys[r]).reason == AFFINITY
    counts = [table.key_counts().get(x, 0) for x in names(n)]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == len(keys)


def router_args(*extra: str):
    from kvfleet.runtime.cli import build_parser

    return build_parser().parse_args(["router", "--upstream", "http://127.0.0.1:9", *extra])


def test_the_table_size_flag_sizes_the_router_s_table_and_0_turns_it_off():
    from kvfleet.runtime.router.app import Router
    from kvfleet.runtime.router.cmd_router import settings_from_args

    urls, s = settings_from_args(router_args())
    assert Router(ReplicaPool(urls), s).pool.placement.max_keys == 65536
    urls, s = settings_from_args(router_args("--placement-table-size", "100"))
    assert Router(ReplicaPool(urls), s).pool.placement.max_keys == 100
    urls, s = settings_from_args(router_args("--placement-table-size", "0"))
    assert Router(ReplicaPool(urls), s).pool.placement is None
    with pytest.raises(ValueError, match="placement_table_size: must be >= 0 keys, got -1"):
        settings_from_args(router_args("--placement-table-size", "-1"))

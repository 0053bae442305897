"""Which replica gets a request: a pure function of the replicas' state and the prompt's key.

`prefix` (the default):
1. no key (no prompt of a block or more): the least-loaded healthy replica.
2. A replica is *overloaded* with more than `max_waiting` requests queued, KV cache at
   `max_kv_usage` or more, or while queueing at all (its last scrape says some request waits)
   with more than `load_factor` times the mean load (the bound of "consistent hashing with
   bounded loads": a hot prefix cannot pile onto one replica). A replica that queues nothing
   runs a further request in the batch it already runs: sending it elsewhere only costs a
   prefill of the prefix (at concurrency 6 over 3 replicas, the bound applied at every load
   moved a third of the requests away from their cache: docs/scaling.md, Measured).
3. With the router's placement table (placement.py; passed in as a `Placement`, so this stays
   a pure function): a key placed before goes back to its replica unless that one is
   overloaded; then it spills to the next replica in the key's rendezvous ranking that is not
   (so a spilled prefix is cached in one more place, not everywhere) and stays placed where it
   was. A new key, or one whose replica is down or gone, is placed on the healthy replica that
   is not overloaded with the fewest keys placed, then the least load, then the best rank in
   the key's rendezvous ranking: 8 keys over 3 idle replicas land 3/3/2 (hashing alone gave
   4/3/1 or 5/2/1), and routers with the same history agree. The caller records the
   placement (`Pick.place`).
4. Without a table, rendezvous hashing alone: the key's ranking over every known replica,
   healthy or not; the first healthy one is the affine replica (when the top one is down its
   keys all move to their runner-up together), taken unless overloaded, else the next in the
   ranking that is not.
5. When every replica is overloaded, the least-loaded one.

A request whose `model` names a LoRA adapter some replica has loaded (its scraped
`kvfleet:lora_adapter_loaded` series) is picked for, as above, among the replicas that have it
only: its prefix affinity, placement and balance bound all apply within that set. A replica
without the adapter would answer 404, so it is never a fallback, not even for an overloaded
set (the least-loaded replica that has it is); only when no healthy replica has it (its load
is under way, or it is not in spec.loras) is the request picked for as any other, and the
replica answers. Base-model requests are picked for as before; `least-loaded` and `random`
keep to the adapter's replicas too.

`least-loaded` and `random` ignore the key (baselines for benchmarks).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet.runtime.router import rendezvous

POLICIES = ("prefix", "least-loaded", "random")
# Pick reasons, as the router's metrics label them.
AFFINITY = "affinity"
FALLBACK_UNHEALTHY = "fallback_unhealthy"
FALLBACK_OVERLOADED = "fallback_overloaded"
LEAST_LOADED = "least_loaded"
RANDOM = "random"
NEW_PREFIX = "new_prefix"  # a key placed for the first time (or again, its replica gone)
REASONS = (AFFINITY, NEW_PREFIX, FALLBACK_UNHEALTHY, FALLBACK_OVERLOADED, LEAST_LOADED, RANDOM)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the policy knows of a replica: its last scrape and this router's own count of the
    requests it has in flight there."""

    name: str
    healthy: bool = True
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded, by name

    @property
    def load(self) -> float:
        """Requests on the replica: the scrape counts every router's but is up to one interval
        old; our own count is current. The larger is the better guess."""
        return max(float(self.in_flight), self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class PolicySettings:
    policy: str = "prefix"
    max_waiting: float = 4.0
    max_kv_usage: float = 0.9
    load_factor: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if not 0 < self.max_kv_usage <= 1:
            raise ValueError(f"max_kv_usage: must be in (0, 1], got {self.max_kv_usage}")
        if self.load_factor < 1:
            raise ValueError(f"load_factor: must be >= 1, got {self.load_factor}")


@dataclass(frozen=True, slots=True)
class Placement:
    """What the router's placement table knows for this request: the replica its key was
    placed on (None: a new key) and how many keys each replica has placed on it."""

    owner: str | None = None
    key_counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pick:
    name: str
    reason: str
    place: bool = False  # the key is now placed on `name`: the caller records it


def pick_replica(
    replicas: Sequence[ReplicaView],
    key: bytes | None,
    settings: PolicySettings,
    exclude: Collection[str] = (),
    rng: random.Random | None = None,
    placement: Placement | None = None,
    model: str | None = None,
) -> Pick | None:
    """The replica for a request with this prefix key (None: no prefix signal); replicas in
    `exclude` (already tried for this request) count as unhealthy. None when none is healthy.
    `placement`: the placement table's view of the key (None: rendezvous hashing alone).
    `model`: the request's model field, which may name a LoRA adapter."""
    replicas = adapter_replicas(replicas, model, exclude)
    healthy = [r for r in replicas if r.healthy and r.name not in exclude]
    if not healthy:
        return None
    if settings.policy == "random":
        return Pick((rng or random).choice(healthy).name, RANDOM)
    if settings.policy == "least-loaded" or key is None:
        return Pick(_least_loaded(healthy, healthy).name, LEAST_LOADED)

    by_name = {r.name: r for r in healthy}
    ranked = rendezvous.rank(key, [r.name for r in replicas])
    ranked_healthy = [by_name[n] for n in ranked if n in by_name]
    affine = ranked_healthy[0]
    cap = _load_cap(healthy, settings.load_factor)
    if placement is not None:
        return _pick_placed(healthy, ranked_healthy, placement, settings, cap, exclude)
    if not _overloaded(affine, settings, cap):
        return Pick(affine.name, AFFINITY if affine.name == ranked[0] else FALLBACK_UNHEALTHY)
    for r in ranked_healthy[1:]:
        if not _overloaded(r, settings, cap):
            return Pick(r.name, FALLBACK_OVERLOADED)
    return Pick(_least_loaded(healthy, ranked_healthy).name, FALLBACK_OVERLOADED)


def _pick_placed(
    healthy: Sequence[ReplicaView],
    ranked_healthy: Sequence[ReplicaView],
    placement: Placement,
    settings: PolicySettings,
    cap: float,
    exclude: Collection[str],
) -> Pick:
    owner = next((r for r in healthy if r.name == placement.owner), None)
    if owner is not None:
        if not _overloaded(owner, settings, cap):
            return Pick(owner.name, AFFINITY)
        # Spill without moving the key: the owner holds its prefix and will be free again.
        # The next not-overloaded replica in the key's ranking, so it spills to one place.
        for r in ranked_healthy:
            if r is not owner and not _overloaded(r, settings, cap):
                return Pick(r.name, FALLBACK_OVERLOADED)
        return Pick(_least_loaded(healthy, ranked_healthy).name, FALLBACK_OVERLOADED)
    # A new key, or its replica is down or gone: place it where the fewest keys are. A replica
    # only skipped for this request (`exclude`: it refused it) keeps the key.
    retried = placement.owner is not None and placement.owner in exclude
    reason = NEW_PREFIX if placement.owner is None else FALLBACK_UNHEALTHY
    position = {r.name: i for i, r in enumerate(ranked_healthy)}
    open_ = [r for r in healthy if not _overloaded(r, settings, cap)]
    if not open_:
        return Pick(_least_loaded(healthy, ranked_healthy).name, FALLBACK_OVERLOADED, not retried)
    best = min(
        open_,
        key=lambda r: (placement.key_counts.get(r.name, 0), r.load, position[r.name]),
    )
    return Pick(best.name, reason, not retried)


def adapter_replicas(
    replicas: Sequence[ReplicaView], model: str | None, exclude: Collection[str] = ()
) -> Sequence[ReplicaView]:
    """The replicas a request for `model` may go to: those that have it loaded when it is an
    adapter a healthy replica (not in `exclude`) has; else all of them."""
    if not model:
        return replicas
    with_it = [r for r in replicas if model in r.adapters]
    if any(r.healthy and r.name not in exclude for r in with_it):
        return with_it
    return replicas


def _load_cap(healthy: Sequence[ReplicaView], load_factor: float) -> float:
    """The most load a replica may have before taking one more request: `load_factor` times
    the mean load once this request is counted (at least 1, so an idle fleet spreads nothing)."""
    total = sum(r.load for r in healthy) + 1
    return max(1.0, math.ceil(load_factor * total / len(healthy)))


def _overloaded(r: ReplicaView, settings: PolicySettings, cap: float) -> bool:
    if r.waiting > settings.max_waiting or r.kv_usage >= settings.max_kv_usage:
        return True
    # The balance bound counts only while the replica queues: until then it batches.
    return r.waiting > 0 and r.load + 1 > cap


def _least_loaded(candidates: Sequence[ReplicaView], order: Sequence[ReplicaView]) -> ReplicaView:
    """The candidate with the least load, then the emptiest cache, then the earliest in
    `order` (the key's ranking, so ties still favour the cache that may hold the prefix)."""
    position = {r.name: i for i, r in enumerate(order)}
    return min(candidates, key=lambda r: (r.load, r.kv_usage, position.get(r.name, len(order))))

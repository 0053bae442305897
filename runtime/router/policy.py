"""Which replica gets a request: a pure function of the replicas' state and the prompt's key.

`prefix` (the default), in order:
1. no key (no prompt of a block or more): the least-loaded healthy replica;
2. the key's rendezvous ranking over every known replica, healthy or not; the first healthy
   one is the affine replica (when the top one is unhealthy its keys all move to their
   runner-up together, so they keep meeting one cache while it is away);
3. the affine replica unless it is overloaded: more than `max_waiting` requests queued, KV
   cache at `max_kv_usage` or more, or queueing at all (its last scrape says some request
   waits) with more than `load_factor` times the mean load (the bound of "consistent hashing
   with bounded loads", which keeps a hot prefix or an unlucky spread of keys from piling
   onto one replica). A replica that queues nothing runs a further request in the batch it
   already runs: sending it elsewhere only costs that replica a prefill of the prefix (at
   concurrency 6 over 3 replicas, the bound alone moved a third of the requests away from
   their cache: docs/scaling.md, Measured);
4. otherwise the next replica in the key's ranking that is not overloaded (a spilled prefix
   spills to the same place each time, so it is cached there once rather than everywhere),
   and when every replica is overloaded, the least-loaded one.

`least-loaded` and `random` ignore the key (baselines for benchmarks).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvfleet.runtime.router import rendezvous

POLICIES = ("prefix", "least-loaded", "random")
# Pick reasons, as the router's metrics label them.
AFFINITY = "affinity"
FALLBACK_UNHEALTHY = "fallback_unhealthy"
FALLBACK_OVERLOADED = "fallback_overloaded"
LEAST_LOADED = "least_loaded"
RANDOM = "random"
REASONS = (AFFINITY, FALLBACK_UNHEALTHY, FALLBACK_OVERLOADED, LEAST_LOADED, RANDOM)


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
class Pick:
    name: str
    reason: str


def pick_replica(
    replicas: Sequence[ReplicaView],
    key: bytes | None,
    settings: PolicySettings,
    exclude: Collection[str] = (),
    rng: random.Random | None = None,
) -> Pick | None:
    """The replica for a request with this prefix key (None: no prefix signal); replicas in
    `exclude` (already tried for this request) count as unhealthy. None when none is healthy."""
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
    if not _overloaded(affine, settings, cap):
        return Pick(affine.name, AFFINITY if affine.name == ranked[0] else FALLBACK_UNHEALTHY)
    for r in ranked_healthy[1:]:
        if not _overloaded(r, settings, cap):
            return Pick(r.name, FALLBACK_OVERLOADED)
    return Pick(_least_loaded(healthy, ranked_healthy).name, FALLBACK_OVERLOADED)


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

"""The router's own Prometheus metrics: how it picked, where requests went, what failed.

The replicas' engine metrics stay on the replicas (vLLM's names, kvfleet/contract.py); these
are about the routing, named kvfleet_router_*.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvfleet.runtime.router.policy import REASONS
from kvfleet.runtime.router.replica_pool import ReplicaPool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PICKS = "kvfleet_router_picks"  # counter, label reason (policy.REASONS)
UPSTREAM_REQUESTS = "kvfleet_router_upstream_requests"  # counter, label upstream
UPSTREAM_ERRORS = "kvfleet_router_upstream_errors"  # counter, labels upstream, kind
RETRIES = "kvfleet_router_retries"  # counter: requests sent again to another replica
NO_REPLICA = "kvfleet_router_no_replica"  # counter: requests answered 503, none healthy
# The activator (scale from zero, activator.py):
COLD_STARTS = "kvfleet_router_cold_starts"  # counter: Deployment scaled 0 → 1 by this router
COLD_START_SECONDS = "kvfleet_router_cold_start_seconds"  # histogram: first held → ready
HELD_REQUESTS = "kvfleet_router_held_requests"  # gauge: requests waiting for a first replica
ACTIVATOR_REFUSED = "kvfleet_router_activator_refused"  # counter, label reason
REFUSE_REASONS = ("queue_full", "timeout")
# A GPU replica's cold start: pod scheduling, image and model loading, often minutes.
COLD_START_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
UPSTREAM_HEALTHY = "kvfleet_router_upstream_healthy"  # gauge 0/1, label upstream
UPSTREAM_IN_FLIGHT = "kvfleet_router_upstream_in_flight"  # gauge, label upstream
# Error kinds: connect (refused, unreachable), timeout, status (a 5xx answer), stream (the
# connection broke after the answer began).
ERROR_KINDS = ("connect", "timeout", "status", "stream")


class RouterMetrics:
    """One registry per router."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.registry = CollectorRegistry()
        self.picks = Counter(PICKS, "Replica picks by reason.", ["reason"], registry=self.registry)
        for reason in REASONS:  # present from the start, so rate() sees the first one
            self.picks.labels(reason)
        self.upstream_requests = Counter(
            UPSTREAM_REQUESTS,
            "Requests sent to each replica.",
            ["upstream"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            UPSTREAM_ERRORS,
            "Failed requests to each replica, by kind (connect, timeout, status, stream).",
            ["upstream", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            RETRIES, "Requests sent again to another replica.", registry=self.registry
        )
        self.no_replica = Counter(
            NO_REPLICA, "Requests refused because no replica was healthy.", registry=self.registry
        )
        self.cold_starts = Counter(
            COLD_STARTS,
            "Times this router scaled the Deployment from 0 to 1 replica for a held request.",
            registry=self.registry,
        )
        self.cold_start_seconds = Histogram(
            COLD_START_SECONDS,
            "Seconds from the first request held with no ready replica to a ready replica.",
            buckets=COLD_START_BUCKETS,
            registry=self.registry,
        )
        self.held = Gauge(
            HELD_REQUESTS,
            "Requests held while no replica is ready (scale from zero).",
            registry=self.registry,
        )
        self.activator_refused = Counter(
            ACTIVATOR_REFUSED,
            "Requests answered 503 while no replica was ready: queue_full or timeout.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REFUSE_REASONS:
            self.activator_refused.labels(reason)
        self.registry.register(_PoolCollector(pool))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    """The replicas' health and this router's in-flight counts, read at scrape time."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            UPSTREAM_HEALTHY, "1 while a replica takes requests.", labels=["upstream"]
        )
        in_flight = GaugeMetricFamily(
            UPSTREAM_IN_FLIGHT,
            "Requests this router has in flight on a replica.",
            labels=["upstream"],
        )
        for r in self._pool.replicas:
            healthy.add_metric([r.url], 1.0 if r.healthy else 0.0)
            in_flight.add_metric([r.url], float(r.in_flight))
        yield healthy
        yield in_flight

"""The operator's own Prometheus metrics (names from kvfleet.contract), on a private registry."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvfleet import contract

# A private registry: the operator's /metrics shows only these, never the process collectors'
# names colliding with another component imported in the same process (tests).
REGISTRY = CollectorRegistry()

RECONCILES = Counter(
    contract.OPERATOR_RECONCILES,
    "Reconciles of InferenceServices and their children, by trigger and result.",
    ["kind", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    contract.OPERATOR_RECONCILE_ERRORS,
    "Reconciles that failed, by reason (spec problem reason or API error).",
    ["reason"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    contract.OPERATOR_RECONCILE_DURATION,
    "Time one reconcile takes, API calls included.",
    registry=REGISTRY,
)
REPLICAS = Gauge(
    contract.INFERENCESERVICE_REPLICAS,
    "Pods of an InferenceService.",
    ["namespace", "name"],
    registry=REGISTRY,
)
READY_REPLICAS = Gauge(
    contract.INFERENCESERVICE_READY_REPLICAS,
    "Ready pods of an InferenceService.",
    ["namespace", "name"],
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    contract.INFERENCESERVICE_DESIRED_REPLICAS,
    "Replicas the autoscaler last asked for.",
    ["namespace", "name"],
    registry=REGISTRY,
)
READY = Gauge(
    contract.INFERENCESERVICE_READY,
    "1 when the InferenceService's Ready condition is True.",
    ["namespace", "name"],
    registry=REGISTRY,
)


@contextmanager
def reconcile_timer(kind: str) -> Iterator[None]:
    """Count one reconcile of `kind` and time it; an exception counts as result=error."""
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        RECONCILES.labels(kind=kind, result="error").inc()
        raise
    else:
        RECONCILES.labels(kind=kind, result="ok").inc()
    finally:
        RECONCILE_DURATION.observe(time.perf_counter() - start)


def observe_status(namespace: str, name: str, status: dict) -> None:
    """Mirror an InferenceService's status into the per-object gauges."""
    REPLICAS.labels(namespace=namespace, name=name).set(status.get("replicas") or 0)
    READY_REPLICAS.labels(namespace=namespace, name=name).set(status.get("readyReplicas") or 0)
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    READY.labels(namespace=namespace, name=name).set(1 if ready else 0)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted InferenceService's series so they stop being exported."""
    for gauge in (REPLICAS, READY_REPLICAS, DESIRED_REPLICAS, READY):
        with suppress(KeyError):
            gauge.remove(namespace, name)


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Expose REGISTRY on http://host:port/metrics (a daemon thread)."""
    start_http_server(port, addr=host, registry=REGISTRY)

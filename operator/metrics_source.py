"""Reading the autoscaler's signals: from each pod's /metrics, or from an existing Prometheus.

Both ways yield one `PodSample` per pod (autoscaler.py). A pod whose numbers cannot be read
is a sample with `scraped=False` and an `error`, never an exception and never zeros: zeros
would read as an idle pod and invite a scale-down.

Several series per metric (one per `model_name` label set) are combined per pod as
kvfleet/runtime_load.py says (the parser the router shares): waiting and running summed,
KV-cache usage the maximum.

Prometheus mode runs four instant queries against `/api/v1/query`, each grouped by pod over
the InferenceService's pods (`NS` and `NAME` filled in, label values escaped):

    sum by (pod) (vllm:num_requests_waiting{namespace="NS", app_kubernetes_io_instance="NAME"})
    sum by (pod) (vllm:num_requests_running{namespace="NS", app_kubernetes_io_instance="NAME"})
    max by (pod) (vllm:kv_cache_usage_perc{namespace="NS", app_kubernetes_io_instance="NAME"})
    sum by (pod) (vllm:request_success_total{namespace="NS", app_kubernetes_io_instance="NAME"})

The last (finished requests, for scale to zero's idle clock) may lack a pod: a counter with no
request finished yet has no series, which is 0, not missing data.

This assumes the scrape configuration (a PodMonitor or kubernetes_sd relabeling) keeps the
pod's `app.kubernetes.io/instance` label as `app_kubernetes_io_instance`, plus `namespace`
and `pod`, which is what the Prometheus operator's PodMonitor does with `podTargetLabels`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import aiohttp
from kvfleet.operator.autoscaler import PodSample

from kvfleet.contract import (
    KV_CACHE_USAGE_PERC,
    METRICS_PATH,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    REQUEST_SUCCESS,
)

# The parser is shared with the router; the operator's callers keep reading it from here.
from kvfleet.runtime_load import MetricsParseError, parse_runtime_metrics

INSTANCE_LABEL = "app_kubernetes_io_instance"  # app.kubernetes.io/instance, as Prometheus names it


class MetricsUnavailable(RuntimeError):
    """Prometheus could not be queried (down, bad URL, or an error answer)."""


class PodTarget(NamedTuple):
    """A pod to read: its name, IP (empty while unscheduled) and readiness."""

    name: str
    ip: str
    ready: bool


async def scrape_pods(
    pods: Iterable[PodTarget | tuple[str, str, bool]],
    port: int,
    timeout: float,
    session: aiohttp.ClientSession,
) -> list[PodSample]:
    """Scrape every ready pod's `http://<ip>:<port>/metrics` concurrently, each within
    `timeout` seconds. One sample per pod, in the given order; failures are samples too."""
    targets = [PodTarget(*pod) for pod in pods]
    return list(
        await asyncio.gather(*(_scrape_one(target, port, timeout, session) for target in targets))
    )


async def _scrape_one(
    target: PodTarget, port: int, timeout: float, session: aiohttp.ClientSession
) -> PodSample:
    if not target.ready:
        return PodSample(target.name, ready=False, scraped=False, error="pod not ready")
    if not target.ip:
        return PodSample(target.name, ready=True, scraped=False, error="pod has no IP")
    host = f"[{target.ip}]" if ":" in target.ip else target.ip  # IPv6 pod IPs
    url = f"http://{host}:{port}{METRICS_PATH}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return _failed(target, f"GET {url}: HTTP {response.status}")
            text = await response.text()
        load = parse_runtime_metrics(text)
    except TimeoutError:
        return _failed(target, f"GET {url}: no answer within {timeout:g}s")
    except (aiohttp.ClientError, MetricsParseError, UnicodeDecodeError) as error:
        return _failed(target, f"GET {url}: {error or type(error).__name__}")
    return PodSample(
        target.name,
        ready=True,
        scraped=True,
        waiting=load.waiting,
        running=load.running,
        kv_usage=load.kv_usage,
        finished=load.finished,
    )


def _failed(target: PodTarget, error: str) -> PodSample:
    return PodSample(target.name, ready=target.ready, scraped=False, error=error)


def promql_queries(namespace: str, name: str) -> dict[str, str]:
    """The four PromQL instant queries for an InferenceService, keyed by signal."""
    selector = f'{{namespace="{_escape(namespace)}", {INSTANCE_LABEL}="{_escape(name)}"}}'
    return {
        "waiting": f"sum by (pod) ({NUM_REQUESTS_WAITING}{selector})",
        "running": f"sum by (pod) ({NUM_REQUESTS_RUNNING}{selector})",
        "kv_usage": f"max by (pod) ({KV_CACHE_USAGE_PERC}{selector})",
        "finished": f"sum by (pod) ({REQUEST_SUCCESS}_total{selector})",
    }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def query_prometheus(
    url: str,
    namespace: str,
    name: str,
    session: aiohttp.ClientSession,
    timeout: float,
    pods: Sequence[PodTarget | tuple[str, str, bool]] | None = None,
) -> list[PodSample]:
    """Read the signals of InferenceService `namespace/name` from Prometheus at `url`.

    Without `pods`: one sample per pod Prometheus knows (all taken as ready). With `pods`
    (the pods the operator sees): one sample per given pod, in order; a pod Prometheus has no
    complete data for is `scraped=False`, and series of pods no longer listed are ignored.
    Raises MetricsUnavailable when Prometheus cannot be queried at all.
    """
    queries = promql_queries(namespace, name)
    endpoint = url.rstrip("/") + "/api/v1/query"
    results = await asyncio.gather(
        *(_instant_query(endpoint, q, session, timeout) for q in queries.values())
    )
    by_signal = dict(zip(queries, results, strict=True))

    if pods is None:
        names = sorted(set().union(*(r.keys() for r in results)))
        targets = [PodTarget(pod, "", True) for pod in names]
    else:
        targets = [PodTarget(*pod) for pod in pods]

    samples = []
    for target in targets:
        lacking = [
            signal
            for signal, result in by_signal.items()
            if target.name not in result and signal != "finished"
        ]
        if not target.ready:
            samples.append(_failed(target, "pod not ready"))
        elif lacking:
            samples.append(
                _failed(target, f"Prometheus has no {', '.join(lacking)} series for this pod")
            )
        else:
            samples.append(
                PodSample(
                    target.name,
                    ready=True,
                    scraped=True,
                    waiting=by_signal["waiting"][target.name],
                    running=by_signal["running"][target.name],
                    kv_usage=by_signal["kv_usage"][target.name],
                    finished=by_signal["finished"].get(target.name, 0.0),
                )
            )
    return samples


async def _instant_query(
    endpoint: str, query: str, session: aiohttp.ClientSession, timeout: float
) -> dict[str, float]:
    """Run one instant query; {pod: value} from its vector result."""
    try:
        async with session.get(
            endpoint, params={"query": query}, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            status = response.status
            body = await response.json(content_type=None)
    except TimeoutError as error:
        raise MetricsUnavailable(f"Prometheus {endpoint}: no answer within {timeout:g}s") from error
    except (aiohttp.ClientError, ValueError) as error:
        raise MetricsUnavailable(f"Prometheus {endpoint}: {error}") from error
    if not isinstance(body, dict) or body.get("status") != "success":
        detail = body.get("error", body) if isinstance(body, dict) else body
        raise MetricsUnavailable(f"Prometheus {endpoint}: HTTP {status}: {detail} (query: {query})")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise MetricsUnavailable(
            f"Prometheus {endpoint}: expected a vector result, got {data.get('resultType')!r}"
        )
    values: dict[str, float] = {}
    for series in data.get("result", []):
        pod = series.get("metric", {}).get("pod")
        try:
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise MetricsUnavailable(
                f"Prometheus {endpoint}: malformed sample {series!r}"
            ) from error
        # A series without a pod label cannot be attributed; NaN is no data, not zero.
        if pod and math.isfinite(value):
            values[pod] = value
    return values

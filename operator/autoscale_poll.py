"""One autoscaler poll of one InferenceService: its I/O around the pure decision.

The Deployment's replicas and its pods (label selector from the Deployment; pods being deleted
are leaving and do not count) → `scrape_pods` (or `query_prometheus`) → `decide_replicas`
(autoscaler.py) with the history the loop keeps in `AutoscalerState` → when desired != current,
a merge patch of the Deployment's replicas (preconditioned on its resourceVersion, so a
concurrent `kubectl scale` is not overwritten blindly) and a `ScaledUp`/`ScaledDown` Event →
`status.autoscaling` and the `AutoscalerReady` condition (autoscale_report.py builds them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvfleet.operator import conditions as c
from kvfleet.operator import metrics
from kvfleet.operator.apply import AUTOSCALER_MANAGER
from kvfleet.operator.autoscale_report import (
    AUTOSCALER_READY,
    SCALED_DOWN,
    SCALED_TO_ZERO,
    SCALED_UP,
    PollReport,
    autoscaling_status,
    readiness,
    scale_event,
)
from kvfleet.operator.autoscaler import History, PodSample, decide_replicas
from kvfleet.operator.idle import IdleClock, observe
from kvfleet.operator.kube_api import DEPLOYMENTS, EVENTS, ISVCS, PODS, KubeApi, KubeApiError
from kvfleet.operator.metrics_source import (
    MetricsUnavailable,
    PodTarget,
    query_prometheus,
    scrape_pods,
)
from kvfleet.operator.spec import AutoscalingSpec, SpecError, parse_autoscaling

from kvfleet import contract

log = logging.getLogger("kvfleet.autoscaler")


def scrape_timeout(poll_interval: float) -> float:
    """Seconds one pod gets to answer /metrics: the poll interval, within 1..5 s.

    A loaded runtime answers slowly; a scrape that times out counts as missing data, which
    blocks scale-downs, so the timeout errs long (a poll may then take longer than its
    interval: the next one simply starts at once).
    """
    return max(1.0, min(5.0, poll_interval))


@dataclass(slots=True)
class AutoscalerState:
    """What the loop of one InferenceService remembers between polls (restarts forget it)."""

    history: History = ()
    missing_polls: Mapping[str, int] = field(default_factory=dict)  # pod -> polls in a row
    last_scale_time: str | None = None
    idle: IdleClock | None = None  # scale to zero: since when no request was seen (idle.py)


def pod_targets(pods: Sequence[Mapping[str, Any]]) -> list[PodTarget]:
    """The pods that are capacity now or soon: not being deleted, not finished. Readiness from
    the pod's Ready condition (a not-ready pod is missing data, never idle capacity)."""
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ready = any(
            cond.get("type") == "Ready" and cond.get("status") == "True"
            for cond in status.get("conditions") or []
        )
        targets.append(PodTarget(meta.get("name", ""), status.get("podIP") or "", ready))
    return sorted(targets, key=lambda t: t.name)


def _selector(deployment: Mapping[str, Any]) -> str:
    labels = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def scale_deployment(api: KubeApi, namespace: str, name: str, expected: int, desired: int) -> bool:
    """Set the Deployment's replicas from `expected` to `desired`; False (and no change) when
    someone else changed them meanwhile — the next poll decides again from the new count."""

    def compute(deployment: dict[str, Any]) -> dict[str, Any] | None:
        if (deployment.get("spec") or {}).get("replicas", 1) != expected:
            return None
        return {"spec": {"replicas": desired}}

    outcome = api.patch_preconditioned(
        DEPLOYMENTS, namespace, name, compute, field_manager=AUTOSCALER_MANAGER
    )
    return outcome == "written"


def write_status(
    api: KubeApi,
    namespace: str,
    name: str,
    autoscaling: Mapping[str, Any] | None,
    ready: c.Condition,
) -> None:
    """Merge `status.autoscaling` and the AutoscalerReady condition into the object's status,
    preconditioned on resourceVersion so the reconciler's latest conditions are never lost."""

    def compute(isvc: dict[str, Any]) -> dict[str, Any] | None:
        if isvc["metadata"].get("deletionTimestamp"):
            return None
        status = isvc.get("status") or {}
        conds = c.merge_conditions(
            status.get("conditions"),
            [ready],
            observed_generation=int(isvc["metadata"].get("generation") or 0),
        )
        new: dict[str, Any] = {"conditions": conds}
        if autoscaling is not None:
            new["autoscaling"] = {**(status.get("autoscaling") or {}), **autoscaling}
        if all(status.get(k) == v for k, v in new.items()):
            return None
        return {"status": new}

    if api.patch_preconditioned(ISVCS, namespace, name, compute, sub="status") == "conflict":
        log.info(
            "%s/%s: status changed under every write attempt; the next poll writes it",
            namespace,
            name,
        )


async def read_samples(
    spec: AutoscalingSpec,
    namespace: str,
    name: str,
    targets: Sequence[PodTarget],
    port: int,
    session: aiohttp.ClientSession,
) -> list[PodSample]:
    """One sample per target, from the pods themselves or from Prometheus.

    Raises MetricsUnavailable when Prometheus cannot be queried.
    """
    timeout = scrape_timeout(spec.poll_interval_seconds)
    if spec.metrics_source == "prometheus":
        assert spec.prometheus_url is not None  # AutoscalingSpec.check guarantees it
        return await query_prometheus(
            spec.prometheus_url, namespace, name, session, timeout, pods=targets
        )
    return await scrape_pods(targets, port, timeout, session)


async def poll_once(
    api: KubeApi,
    isvc: Mapping[str, Any],
    state: AutoscalerState,
    session: aiohttp.ClientSession,
    port: int = contract.RUNTIME_PORT,
) -> PollReport | None:
    """One poll for one InferenceService: read, decide, scale, record. None when there is
    nothing to decide about yet (no Deployment) or the spec cannot be used."""
    meta = isvc["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        spec = parse_autoscaling((isvc.get("spec") or {}).get("autoscaling")).check()
    except SpecError as exc:
        # The reconciler reports some of these as Degraded too (spec_check); here: why nothing
        # scales.
        ready = c.Condition(AUTOSCALER_READY, c.FALSE, "InvalidSpec", str(exc))
        await asyncio.to_thread(write_status, api, namespace, name, None, ready)
        return None
    deployment = await asyncio.to_thread(api.get, DEPLOYMENTS, namespace, name)
    if deployment is None:
        ready = c.Condition(
            AUTOSCALER_READY, c.FALSE, "DeploymentMissing", "the Deployment does not exist yet"
        )
        await asyncio.to_thread(write_status, api, namespace, name, None, ready)
        return None
    current = int((deployment.get("spec") or {}).get("replicas", 1))
    pods = await asyncio.to_thread(api.list, PODS, namespace, _selector(deployment))
    targets = pod_targets(pods)

    error = ""
    try:
        samples = await read_samples(spec, namespace, name, targets, port, session)
    except MetricsUnavailable as exc:
        error = str(exc)
        # Nothing read: every pod counts as missing, so the decision can only hold (or fix
        # bounds), never scale down.
        samples = [PodSample(t.name, t.ready, scraped=False, error=error) for t in targets]

    now = time.monotonic()
    state.idle = observe(state.idle, samples, current, now)
    decision = decide_replicas(
        samples,
        current,
        spec,
        state.history,
        now,
        state.missing_polls,
        idle_for=state.idle.idle_for(now) if spec.min_replicas == 0 else None,
    )
    state.history, state.missing_polls = decision.history, decision.missing_polls
    metrics.DESIRED_REPLICAS.labels(namespace=namespace, name=name).set(decision.desired)

    scaled = False
    if decision.desired != current:
        scaled = await asyncio.to_thread(
            scale_deployment, api, namespace, name, current, decision.desired
        )
        if scaled:
            # The clock remembers the count after this poll: a scale-up from the 0 written
            # here, before the next poll, is then still seen as one (idle.py).
            state.idle = dataclasses.replace(state.idle, replicas=decision.desired)
            state.last_scale_time = c.now_rfc3339()
            reason = SCALED_UP if decision.direction == "up" else SCALED_DOWN
            if decision.desired == 0:
                reason = SCALED_TO_ZERO
            log.info("%s/%s: %s: %s", namespace, name, reason, decision.reason)
            try:
                await asyncio.to_thread(
                    api.create,
                    EVENTS,
                    namespace,
                    scale_event(isvc, reason, decision.reason, state.last_scale_time),
                )
            except KubeApiError as exc:
                # The scale happened; a lost Event must not undo or repeat it.
                log.warning("%s/%s: could not post the %s Event: %s", namespace, name, reason, exc)
    if state.last_scale_time is None:
        last = ((isvc.get("status") or {}).get("autoscaling") or {}).get("lastScaleTime")
        state.last_scale_time = last or None

    ready = readiness(samples, decision, error)
    await asyncio.to_thread(
        write_status,
        api,
        namespace,
        name,
        autoscaling_status(decision, state.last_scale_time),
        ready,
    )
    return PollReport(
        namespace=namespace,
        name=name,
        at=time.time(),
        current=current,
        desired=decision.desired,
        scaled=scaled,
        reason=decision.reason,
        total_waiting=decision.total_waiting,
        total_running=decision.total_running,
        mean_kv_usage=decision.mean_kv_usage,
        pods_reporting=decision.pods_reporting,
        pods_missing=decision.pods_missing,
        ready=ready,
    )

"""The autoscaler's loop: per InferenceService with autoscaling on, read load, decide, scale.

One kopf daemon per InferenceService whose `spec.autoscaling.enabled` is true (kopf starts it
when the filter matches and stops it when it no longer does). Unlike kopf's default, the daemon
puts no finalizer on the InferenceService: it ends itself on the InferenceService's DELETED
event (or at the next poll, should that event be missed), so deleting one never waits for the
operator (an uninstalled operator would otherwise leave every autoscaled InferenceService stuck
in Terminating).

A daemon rather than a `@kopf.timer`: a timer's interval is fixed at registration, while
`pollIntervalSeconds` is per object and may change; the daemon rereads the live spec each poll
and sleeps until the next one is due (a timer with a small base tick that skips polls would do
the same with a log line per tick).

Each poll: the Deployment's replicas and its pods (label selector from the Deployment; pods
being deleted are leaving and do not count) → `scrape_pods` (or `query_prometheus`) →
`decide_replicas` with the history this daemon keeps in memory → when desired != current, a
merge patch of the Deployment's replicas (preconditioned on its resourceVersion, so a
concurrent `kubectl scale` is not overwritten blindly) and a `ScaledUp`/`ScaledDown` Event →
`status.autoscaling` and the `AutoscalerReady` condition. The decision itself is pure
(autoscaler.py); everything here is I/O.

Settings in `OperatorConfig.extra` (for tests and the demo; a cluster needs neither):
- `RUNTIME_PORT_SETTING`: the port scraped on each pod IP (default contract.RUNTIME_PORT);
- `OBSERVERS_SETTING`: callables given a `PollReport` after each poll (the demo's live view).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from kvfleet.operator import conditions as c
from kvfleet.operator import metrics
from kvfleet.operator.apply import AUTOSCALER_MANAGER
from kvfleet.operator.autoscaler import (
    STALE_AFTER_POLLS,
    Decision,
    History,
    PodSample,
    decide_replicas,
)
from kvfleet.operator.idle import IdleClock, observe
from kvfleet.operator.kube_api import DEPLOYMENTS, ISVCS, PODS, KubeApi, KubeApiError
from kvfleet.operator.metrics_source import (
    MetricsUnavailable,
    PodTarget,
    query_prometheus,
    scrape_pods,
)
from kvfleet.operator.spec import AutoscalingSpec, SpecError, parse_autoscaling

from kvfleet import contract

log = logging.getLogger("kvfleet.autoscaler")

EVENTS = ("", "v1", "events")
AUTOSCALER_READY = "AutoscalerReady"
SCALED_UP, SCALED_DOWN = "ScaledUp", "ScaledDown"
SCALED_TO_ZERO = "ScaledToZero"  # the Event and AutoscalerReady reason at 0 replicas
RUNTIME_PORT_SETTING = "runtime_port"
OBSERVERS_SETTING = "autoscaler_observers"
MAX_ERRORS_SHOWN = 3
DAEMON_ID = "autoscaler"


def scrape_timeout(poll_interval: float) -> float:
    """Seconds one pod gets to answer /metrics: the poll interval, within 1..5 s.

    A loaded runtime answers slowly; a scrape that times out counts as missing data, which
    blocks scale-downs, so the timeout errs long (a poll may then take longer than its
    interval: the next one simply starts at once).
    """
    return max(1.0, min(5.0, poll_interval))


@dataclass(slots=True, frozen=True)
class PollReport:
    """What one poll saw and did, for observers (the demo) and logs."""

    namespace: str
    name: str
    at: float  # time.time()
    current: int
    desired: int  # what the decision asked for
    scaled: bool  # whether the Deployment was changed to it
    reason: str
    total_waiting: float
    total_running: float
    mean_kv_usage: float | None
    pods_reporting: int
    pods_missing: int
    ready: c.Condition


@dataclass(slots=True)
class AutoscalerState:
    """What one InferenceService's daemon remembers between polls."""

    history: History = ()
    missing_polls: Mapping[str, int] = field(default_factory=dict)  # pod -> polls in a row
    last_scale_time: str | None = None
    errors: list[str] = field(default_factory=list)
    idle: IdleClock | None = None  # scale to zero: since when no request was seen (idle.py)


def autoscaling_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf filter: the daemon runs only while `spec.autoscaling.enabled` is true."""
    auto = spec.get("autoscaling")
    return isinstance(auto, Mapping) and auto.get("enabled") is True


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


def readiness(
    samples: Sequence[PodSample], decision: Decision | None, error: str = ""
) -> c.Condition:
    """The AutoscalerReady condition for one poll's outcome."""
    if error:
        return c.Condition(AUTOSCALER_READY, c.FALSE, "PrometheusUnavailable", error)
    failed = [s for s in samples if s.ready and not s.scraped]
    if failed:
        shown = "; ".join(f"{s.pod}: {s.error}" for s in failed[:MAX_ERRORS_SHOWN])
        extra = len(failed) - MAX_ERRORS_SHOWN
        more = f" (and {extra} more)" if extra > 0 else ""
        ignored = set(decision.pods_ignored) if decision else set()
        if all(s.pod in ignored for s in failed):
            consequence = (
                f"unreadable for more than {STALE_AFTER_POLLS} polls, so no longer holding "
                "replicas up"
            )
        else:
            consequence = "so replicas will not go down"
        return c.Condition(
            AUTOSCALER_READY,
            c.FALSE,
            "MetricsUnavailable",
            f"metrics of {len(failed)} of {len(samples)} pods could not be read, {consequence}: "
            f"{shown}{more}",
        )
    if decision is not None and decision.current == decision.desired == 0:
        return c.Condition(AUTOSCALER_READY, c.TRUE, SCALED_TO_ZERO, decision.reason)
    if not any(s.reporting for s in samples):
        return c.Condition(
            AUTOSCALER_READY,
            c.FALSE,
            "NoReadyPods",
            "no pod is ready to report load yet; holding replicas",
        )
    return c.Condition(
        AUTOSCALER_READY, c.TRUE, "MetricsAvailable", decision.reason if decision else ""
    )


def autoscaling_status(
    decision: Decision, last_scale_time: str | None
) -> dict[str, int | float | str]:
    """`status.autoscaling` as the CRD describes it (queue depth per reporting replica)."""
    status: dict[str, int | float | str] = {
        "desiredReplicas": decision.desired,
        "currentReplicas": decision.current,
    }
    if decision.pods_reporting:
        status["queueDepth"] = round(decision.total_waiting / decision.pods_reporting, 3)
    if decision.mean_kv_usage is not None:
        status["kvCacheUsage"] = round(decision.mean_kv_usage, 4)
    if last_scale_time:
        status["lastScaleTime"] = last_scale_time
    return status


def scale_event(isvc: Mapping[str, Any], reason: str, message: str, now: str) -> dict[str, Any]:
    """A core/v1 Event about the InferenceService, as `kubectl describe` lists them."""
    meta = isvc["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
            "kind": contract.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "reason": reason,
        "message": message[:1024],  # the API server's limit for an Event message
        "type": "Normal",
        "source": {"component": "kvfleet-autoscaler"},
        "reportingComponent": f"{contract.API_GROUP}/autoscaler",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


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


def _poll_interval(spec: Mapping[str, Any]) -> float:
    try:
        return parse_autoscaling(spec.get("autoscaling")).check().poll_interval_seconds
    except SpecError:
        return parse_autoscaling(None).poll_interval_seconds


def register(registry: kopf.OperatorRegistry, config: Any) -> None:
    """Add the autoscaler daemon to the operator's registry (handlers.build_registry calls
    this). `config` is handlers.OperatorConfig; see the module docstring for its settings."""
    # With no finalizer, kopf forgets an object at its DELETED event without stopping its
    # daemon; that event ends the daemon here instead (by the object's uid).
    deleted: dict[str, asyncio.Event] = {}

    @kopf.on.event(*ISVCS, registry=registry)
    async def isvc_deleted(type: str, body: kopf.Body, **_: Any) -> None:
        if type == "DELETED" and (event := deleted.get(body.metadata.get("uid", ""))):
            event.set()

    @kopf.daemon(
        *ISVCS,
        id=DAEMON_ID,
        registry=registry,
        when=autoscaling_enabled,
        cancellation_timeout=10,
        backoff=5,
    )
    async def autoscaler(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
        uid = body.metadata.get("uid", "")
        gone = deleted.setdefault(uid, asyncio.Event())
        try:
            await poll_until_stopped(config, body, stopped, gone)
        finally:
            deleted.pop(uid, None)

    _drop_finalizer(registry, DAEMON_ID)


async def poll_until_stopped(
    config: Any, body: kopf.Body, stopped: kopf.DaemonStopped, gone: asyncio.Event
) -> None:
    """The daemon's loop: poll every pollIntervalSeconds until kopf stops the daemon or the
    InferenceService is deleted (`gone` set by its DELETED event or, should that be missed,
    seen by the check before each poll). Returning then is final: kopf does not restart a
    daemon that returned."""
    api: KubeApi = config.client()
    port = int(config.extra.get(RUNTIME_PORT_SETTING, contract.RUNTIME_PORT))
    observers: Sequence[Callable[[PollReport], None]] = config.extra.get(OBSERVERS_SETTING, ())
    state = AutoscalerState()
    namespace, name = body.metadata["namespace"], body.metadata["name"]
    async with aiohttp.ClientSession() as session:
        while not stopped:
            started = time.monotonic()
            if gone.is_set() or await asyncio.to_thread(_gone, api, body):
                metrics.forget(namespace, name)
                return
            # kopf keeps `body` current as watch events arrive: each poll sees the live spec.
            isvc = {
                "metadata": dict(body.metadata),
                "spec": dict(body.spec),
                "status": dict(body.status),
            }
            try:
                report = await poll_once(api, isvc, state, session, port)
            except KubeApiError as exc:
                if not exc.retryable:
                    raise
                log.warning("%s/%s: Kubernetes API: %s; retrying next poll", namespace, name, exc)
                report = None
            if report is not None:
                for observe in observers:
                    try:
                        observe(report)
                    except Exception:  # a watcher's bug must not stop the scaling
                        log.exception("autoscaler observer %r failed", observe)
            interval = _poll_interval(body.spec)
            await _pause(stopped, gone, max(0.0, interval - (time.monotonic() - started)))


async def _pause(stopped: kopf.DaemonStopped, gone: asyncio.Event, seconds: float) -> None:
    """Sleep until the next poll is due, the daemon is stopped or its object deleted."""
    waits = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(gone.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _gone(api: KubeApi, body: Mapping[str, Any]) -> bool:
    """Whether this daemon's InferenceService was deleted (or deleted and created again)."""
    meta = body["metadata"]
    try:
        live = api.get(ISVCS, meta["namespace"], meta["name"])
    except KubeApiError:
        return False  # cannot tell: poll as usual, which reports the API problem
    if live is None:
        return True
    live_meta = live.get("metadata") or {}
    return live_meta.get("uid") != meta.get("uid") or bool(live_meta.get("deletionTimestamp"))


def _drop_finalizer(registry: kopf.OperatorRegistry, handler_id: str) -> None:
    # kopf marks every daemon as needing a finalizer (so it can stop the daemon before the object
    # goes) and offers no option against it (kopf 1.45); the autoscaler stops itself instead
    # (see `register`). tests/operator/test_finalizers.py fails if kopf adds it anyway.
    spawning = registry._spawning
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) if h.id == handler_id else h
        for h in spawning._handlers
    ]

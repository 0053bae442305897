"""The autoscaler's loop under kopf against the emulator, with small aiohttp "pods" serving
fixed /metrics text on their own loopback addresses: scaling, Events, status, the
AutoscalerReady condition, and what it must not do (scale down on missing data, act when off).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from kube_harness import DEPLOYMENT, ISVC, POD, eventually, isvc_with
from kvfleet.operator import metrics
from kvfleet.operator.autoscale_loop import (
    AUTOSCALER_READY,
    OBSERVERS_SETTING,
    RUNTIME_PORT_SETTING,
    PollReport,
)
from kvfleet.operator.autoscaler import STALE_AFTER_POLLS
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.render import selector_labels

NS = "default"
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def metrics_text(waiting: float, running: float = 2, kv: float = 0.3) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    )


def free_port(hosts: tuple[str, ...]) -> int:
    """A port free on every host (the pods share one port, like containerPort 8000)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass(slots=True)
class FakePods:
    """/metrics servers, one per IP; `answers[ip]` is the text or an HTTP status to fail with."""

    port: int
    answers: dict[str, str | int] = field(default_factory=dict)


@pytest.fixture
async def fake_pods() -> AsyncIterator[FakePods]:
    pods = FakePods(free_port(IPS))

    async def serve_metrics(request: web.Request) -> web.Response:
        answer = pods.answers.get(request.url.host or "", 404)
        if isinstance(answer, int):
            return web.Response(status=answer, text="unavailable")
        return web.Response(text=answer, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    for ip in IPS:
        await web.TCPSite(runner, ip, pods.port).start()
    try:
        yield pods
    finally:
        await runner.cleanup()


@pytest.fixture
def polls() -> list[PollReport]:
    return []


@pytest.fixture
def operator_registration(fake_pods, polls):
    def configure(registry, config) -> None:
        config.extra[RUNTIME_PORT_SETTING] = fake_pods.port
        config.extra[OBSERVERS_SETTING] = [polls.append]

    return configure


def add_pod(k8s, isvc_name: str, name: str, ip: str, ready: bool = True) -> None:
    """A pod as the kubelet would report it: the Deployment's labels, an IP, a Ready condition."""
    labels = {**selector_labels(isvc_name), "app.kubernetes.io/managed-by": "kvfleet-operator"}
    k8s.create_object(
        POD,
        {
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "runtime", "image": "kvfleet"}]},
        },
    )
    ready_status = "True" if ready else "False"
    k8s.mutate(
        POD,
        NS,
        name,
        lambda p: p.update(
            status={
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": ready_status}],
            }
        ),
    )


def autoscaled(name: str = "chat", **auto) -> dict:
    spec = {"enabled": True, "pollIntervalSeconds": 1, **auto}
    return isvc_with(name, autoscaling=spec)


def replicas(k8s, name: str = "chat") -> int | None:
    dep = k8s.get(DEPLOYMENT, NS, name)
    return dep["spec"]["replicas"] if dep else None


def events(k8s, reason: str) -> list[dict]:
    """Events with this reason, as `kubectl get events` would list them."""
    return [
        obj.raw
        for (res, _, _), obj in k8s._objects.items()
        if (res.group, res.version, res.plural) == ("", "v1", "events")
        and not obj.deleted
        and obj.raw.get("reason") == reason
    ]


def ready_condition(k8s, name: str = "chat") -> dict | None:
    obj = k8s.get(ISVC, NS, name) or {}
    return find_condition(obj.get("status", {}).get("conditions"), AUTOSCALER_READY)


def autoscaler_ready(k8s, field: str, name: str = "chat") -> str | None:
    """One field of the AutoscalerReady condition; None until the first poll has written it."""
    return (ready_condition(k8s, name) or {}).get(field)


async def test_a_long_queue_scales_up_with_an_event_and_status(operator, fake_pods, polls):
    k8s = operator.emulator
    fake_pods.answers[IPS[0]] = metrics_text(waiting=12, kv=0.5)
    created = k8s.create_object(ISVC, autoscaled(targetQueueDepth=4, maxReplicas=4))
    await eventually(lambda: replicas(k8s) == 1)
    add_pod(k8s, "chat", "chat-a", IPS[0])

    # Recommendation ceil(12 / 4) = 3, but one step at most doubles: 1 -> 2.
    await eventually(lambda: replicas(k8s) == 2, timeout=5)
    (event,) = await eventually(lambda: events(k8s, "ScaledUp"), timeout=3)
    assert event["involvedObject"]["name"] == "chat"
    assert event["involvedObject"]["uid"] == k8s.get(ISVC, NS, "chat")["metadata"]["uid"]
    assert "queue 12 waiting over 1 replica > target 4 per replica" in event["message"]
    assert "scaling 1 → 2" in event["message"]

    status = await eventually(
        lambda: (
            (s := k8s.get(ISVC, NS, "chat")["status"].get("autoscaling"))
            and s.get("desiredReplicas") == 2
            and s
        )
    )
    assert status["currentReplicas"] == 1
    assert status["queueDepth"] == 12 and status["kvCacheUsage"] == 0.5
    assert status["lastScaleTime"].endswith("Z")
    # Eventually, not at once: a reconcile racing with the poll may write its (older) copy of
    # the conditions list; the next poll puts AutoscalerReady back.
    await eventually(lambda: autoscaler_ready(k8s, "status") == "True", timeout=3)
    assert metrics.DESIRED_REPLICAS.labels(namespace=NS, name="chat")._value.get() >= 2
    # Observers hear of a poll once its status write has returned: a moment after it shows.
    await eventually(lambda: any(p.scaled and p.desired == 2 for p in polls), timeout=3)
    # The spec is the user's: the autoscaler changed only the Deployment and the status.
    assert k8s.get(ISVC, NS, "chat")["spec"] == created["spec"]


async def test_a_pod_that_cannot_be_read_blocks_scale_down(operator, fake_pods, polls):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled(minReplicas=1, scaleDownStabilizationSeconds=0))
    await eventually(lambda: replicas(k8s) == 1)
    k8s.mutate(DEPLOYMENT, NS, "chat", lambda d: d["spec"].update(replicas=2))
    fake_pods.answers[IPS[0]] = metrics_text(waiting=0, running=0, kv=0.0)  # idle
    fake_pods.answers[IPS[1]] = 500  # ready, but its /metrics fails
    add_pod(k8s, "chat", "chat-a", IPS[0])
    add_pod(k8s, "chat", "chat-b", IPS[1])

    cond = await eventually(
        lambda: (r := ready_condition(k8s)) and r["reason"] == "MetricsUnavailable" and r,
        timeout=5,
    )
    assert cond["status"] == "False"
    assert "chat-b" in cond["message"] and "HTTP 500" in cond["message"]
    seen = len(polls)
    await eventually(lambda: len(polls) >= seen + 2, timeout=5)  # two more polls
    assert replicas(k8s) == 2 and not events(k8s, "ScaledDown")

    fake_pods.answers[IPS[1]] = metrics_text(waiting=0, running=0, kv=0.0)  # it answers again
    await eventually(lambda: replicas(k8s) == 1, timeout=5)
    (event,) = await eventually(lambda: events(k8s, "ScaledDown"), timeout=3)
    assert "scaling 2 → 1" in event["message"]
    await eventually(lambda: autoscaler_ready(k8s, "status") == "True", timeout=3)


async def test_a_pod_unreadable_for_longer_stops_holding_scale_down(operator, fake_pods, polls):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled(minReplicas=1, scaleDownStabilizationSeconds=0))
    await eventually(lambda: replicas(k8s) == 1)
    k8s.mutate(DEPLOYMENT, NS, "chat", lambda d: d["spec"].update(replicas=2))
    fake_pods.answers[IPS[0]] = metrics_text(waiting=0, running=0, kv=0.0)  # idle
    fake_pods.answers[IPS[1]] = 500  # its /metrics never works
    add_pod(k8s, "chat", "chat-a", IPS[0])
    add_pod(k8s, "chat", "chat-b", IPS[1])

    # Held for STALE_AFTER_POLLS polls of 1 s, then chat-b is ignored and the idle pod decides.
    await eventually(lambda: replicas(k8s) == 1, timeout=STALE_AFTER_POLLS + 6)
    (event,) = await eventually(lambda: events(k8s, "ScaledDown"), timeout=3)
    assert "scaling 2 → 1" in event["message"] and "chat-b" in event["message"]
    # It did hold first: the polls before the scale-down that found chat-b unreadable (the
    # scale-down's own report may not be in yet). The first of them may have read the
    # Deployment before it went to 2 replicas, and the pods after: chat-b counted as missing.
    before = itertools.takewhile(lambda p: not p.scaled, polls)
    held = [p for p in before if "chat-b" in p.ready.message]
    assert len(held) >= STALE_AFTER_POLLS
    await eventually(
        lambda: "no longer holding replicas up" in (autoscaler_ready(k8s, "message") or ""),
        timeout=3,
    )


async def test_a_pod_still_starting_blocks_scale_down_but_not_scale_up(operator, fake_pods):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled(scaleDownStabilizationSeconds=0, targetQueueDepth=2))
    await eventually(lambda: replicas(k8s) == 1)
    k8s.mutate(DEPLOYMENT, NS, "chat", lambda d: d["spec"].update(replicas=2))
    fake_pods.answers[IPS[0]] = metrics_text(waiting=0, running=0, kv=0.0)
    add_pod(k8s, "chat", "chat-a", IPS[0])
    add_pod(k8s, "chat", "chat-b", IPS[1], ready=False)
    await asyncio.sleep(2.5)
    assert replicas(k8s) == 2  # one idle pod and one starting pod is not idle capacity

    fake_pods.answers[IPS[0]] = metrics_text(waiting=10, running=2, kv=0.4)
    await eventually(lambda: replicas(k8s) == 4, timeout=5)  # scales on the pod that answered


async def test_replicas_above_max_come_back_at_once(operator, fake_pods):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled(maxReplicas=3))
    await eventually(lambda: replicas(k8s) == 1)
    k8s.mutate(DEPLOYMENT, NS, "chat", lambda d: d["spec"].update(replicas=7))  # kubectl scale
    await eventually(lambda: replicas(k8s) == 3, timeout=5)
    (event,) = await eventually(lambda: events(k8s, "ScaledDown"))
    assert "above maxReplicas 3" in event["message"]
    await eventually(lambda: autoscaler_ready(k8s, "reason") == "NoReadyPods", timeout=3)


async def test_a_spec_the_autoscaler_cannot_use_is_reported_and_not_acted_on(operator, polls):
    k8s = operator.emulator
    # The CRD refuses this (minimum 1); an object stored before that rule existed still has it.
    k8s.create_object(ISVC, autoscaled(pollIntervalSeconds=0), validate=False)
    await eventually(lambda: replicas(k8s) == 1)  # the reconciler still serves it
    cond = await eventually(
        lambda: (r := ready_condition(k8s)) and r["reason"] == "InvalidSpec" and r, timeout=5
    )
    assert cond["status"] == "False"
    assert cond["message"] == "spec.autoscaling.pollIntervalSeconds: must be >= 1 second, got 0"
    assert not polls and "autoscaling" not in k8s.get(ISVC, NS, "chat")["status"]


async def test_with_autoscaling_off_the_autoscaler_does_nothing(operator, fake_pods, polls):
    k8s = operator.emulator
    obj = isvc_with("chat", replicas=1)
    obj["spec"]["autoscaling"] = {"enabled": False, "pollIntervalSeconds": 1}
    k8s.create_object(ISVC, obj)
    await eventually(lambda: replicas(k8s) == 1)
    fake_pods.answers[IPS[0]] = metrics_text(waiting=50)
    add_pod(k8s, "chat", "chat-a", IPS[0])
    await asyncio.sleep(2.5)
    assert replicas(k8s) == 1 and not polls
    status = k8s.get(ISVC, NS, "chat").get("status", {})
    assert "autoscaling" not in status and ready_condition(k8s) is None

    # Turned on later, the same load scales it.
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"]["autoscaling"].update(enabled=True))
    await eventually(lambda: replicas(k8s) == 2, timeout=6)


async def test_prometheus_as_the_source(operator, fake_pods, polls):
    k8s = operator.emulator
    answers: dict[str, float] = {"waiting": 9, "running": 2, "kv_usage": 0.2, "finished": 40}
    metric = {
        "waiting": "waiting",
        "running": "running",
        "kv_usage": "kv_cache",
        "finished": "request_success",
    }

    async def query(request: web.Request) -> web.Response:
        q = request.query["query"]
        key = next(k for k in answers if metric[k] in q)
        result = [{"metric": {"pod": "chat-a"}, "value": [0, str(answers[key])]}]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port(("127.0.0.1",))
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        k8s.create_object(
            ISVC,
            autoscaled(metricsSource="prometheus", prometheusURL=f"http://127.0.0.1:{port}"),
        )
        await eventually(lambda: replicas(k8s) == 1)
        add_pod(k8s, "chat", "chat-a", "")  # no IP needed: nothing scrapes the pod
        await eventually(lambda: replicas(k8s) == 2, timeout=5)
    finally:
        await runner.cleanup()
    # Prometheus gone: replicas hold and the condition says why.
    cond = await eventually(
        lambda: (r := ready_condition(k8s)) and r["reason"] == "PrometheusUnavailable" and r,
        timeout=6,
    )
    assert cond["status"] == "False" and f"127.0.0.1:{port}" in cond["message"]


async def test_an_idle_service_scales_to_zero_and_says_so(operator, fake_pods, polls):
    # minReplicas 0: starts with one replica; busy (a request finishes each poll) it stays;
    # once nothing happens for scaleToZeroAfterSeconds it goes to 0, with an Event and status.
    k8s = operator.emulator
    obj = autoscaled(minReplicas=0, scaleToZeroAfterSeconds=3)
    obj["spec"]["router"] = {"enabled": True}  # the router that wakes it on a request
    k8s.create_object(ISVC, obj)
    await eventually(lambda: replicas(k8s) == 1)
    add_pod(k8s, "chat", "chat-a", IPS[0])

    def finished(n: int) -> str:
        return (
            metrics_text(waiting=0, running=0, kv=0.0)
            + "# TYPE vllm:request_success counter\n"
            + f'vllm:request_success_total{{model_name="m",finished_reason="stop"}} {n}\n'
        )

    for done in range(1, 6):  # a request finishing between each two polls: 5 s of activity
        fake_pods.answers[IPS[0]] = finished(done)
        await asyncio.sleep(1)
    assert replicas(k8s) == 1 and not events(k8s, "ScaledToZero")
    quiet_from = asyncio.get_running_loop().time()
    await eventually(lambda: replicas(k8s) == 0, timeout=8)
    assert asyncio.get_running_loop().time() - quiet_from >= 3 - 1  # at most a poll early
    (event,) = await eventually(lambda: events(k8s, "ScaledToZero"), timeout=3)
    assert "scaleToZeroAfterSeconds 3" in event["message"] and "scaling 1 → 0" in event["message"]
    await eventually(lambda: autoscaler_ready(k8s, "reason") == "ScaledToZero", timeout=3)
    assert autoscaler_ready(k8s, "status") == "True"
    ready = await eventually(
        lambda: (
            (c := find_condition(k8s.get(ISVC, NS, "chat")["status"].get("conditions"), "Ready"))
            and c["reason"] == "ScaledToZero"
            and c
        ),
        timeout=5,
    )
    assert ready["status"] == "False" and "next request" in ready["message"]
    seen = len(polls)
    await eventually(lambda: len(polls) >= seen + 2, timeout=5)
    assert replicas(k8s) == 0  # and it stays there: nothing but the activator brings it back


async def test_turned_off_the_autoscaler_stops_polling(operator, fake_pods, polls):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled())
    await eventually(lambda: len(polls) >= 2, timeout=6)
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"]["autoscaling"].update(enabled=False))
    await asyncio.sleep(1.5)  # the event reaches the task set; a poll under way may finish
    seen = len(polls)
    await asyncio.sleep(2.5)
    assert len(polls) == seen, "the autoscaler still polls with autoscaling off"


async def test_a_changed_poll_interval_applies_to_the_running_loop(operator, fake_pods, polls):
    k8s = operator.emulator
    k8s.create_object(ISVC, autoscaled(pollIntervalSeconds=1))
    await eventually(lambda: len(polls) >= 2, timeout=6)
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"]["autoscaling"].update(pollIntervalSeconds=3))
    await asyncio.sleep(1.5)  # at most one more poll on the old interval
    start = len(polls)
    await eventually(lambda: len(polls) >= start + 2, timeout=10)
    gap = polls[start + 1].at - polls[start].at
    assert 2.5 <= gap < 4.5, gap

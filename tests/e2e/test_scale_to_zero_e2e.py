"""Scale to zero and back, end to end: the real operator (kopf) on the emulator renders the
runtime and, with `spec.router`, `kvfleet router` with its activator (`--activate-deployment`);
the kubelet simulator runs both as real processes (the router lists pods from, and scales the
Deployment through, the emulator's API).

The story a platform engineer would check, with minReplicas 0 and a short idle timeout: the
service answers through the router; left idle it goes to 0 replicas (its pod stopped, status
Ready=False reason ScaledToZero, an Event); one request through the router is held, wakes the
Deployment 0 → 1, and is answered; the cold start is measured and printed. The replica the
activator started is not removed under it, and once idle again the service goes back to 0.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from kube_harness import DEPLOYMENT, ISVC, eventually, isvc_with
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.autoscale_loop import AUTOSCALER_READY, RUNTIME_PORT_SETTING
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi
from prometheus_client.parser import text_string_to_metric_families

NS = "default"
NAME = "chat"
ROUTER = f"{NAME}-router"
POLL = 1  # pollIntervalSeconds
IDLE = 3  # scaleToZeroAfterSeconds
MAX_TOKENS = 8
MAX_PODS = 3  # the runtime pod, the router pod, and a runtime pod still stopping


@pytest.fixture
def sim_port() -> int:
    # Not the runtime's 8000 that other kubelet-sim tests prefer, nor an ephemeral port: at zero
    # replicas the port is free for a while, and a test beside this one (a shared host) that
    # took it on the same loopback IP would make the woken pod fail to bind.
    return choose_port(pod_ips(MAX_PODS), preferred=random.randrange(20000, 30000))


@pytest.fixture
def operator_registration(sim_port):
    def configure(registry, config) -> None:
        config.extra[RUNTIME_PORT_SETTING] = sim_port

    return configure


def inference_service(model_dir) -> dict:
    return isvc_with(
        NAME,
        model={"uri": f"file://{model_dir}", "servedName": "tiny"},
        resources={"gpus": 0, "cpu": "1", "memory": "1Gi"},
        runtime={
            "maxNumSeqs": 2,
            "maxModelLen": 512,
            "drainTimeoutSeconds": 10,
            "extraArgs": ["--num-threads", "1", "--kv-cache-memory", "1MiB"],
        },
        autoscaling={
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 1,
            "pollIntervalSeconds": POLL,
            "scaleToZeroAfterSeconds": IDLE,
        },
        router={"enabled": True, "extraArgs": ["--scrape-interval", "0.5"]},
    )


def replicas(k8s) -> int:
    return k8s.get(DEPLOYMENT, NS, NAME)["spec"]["replicas"]


def condition(k8s, type_: str) -> dict:
    return find_condition(k8s.get(ISVC, NS, NAME).get("status", {}).get("conditions"), type_) or {}


def events(k8s, reason: str) -> list[dict]:
    return [
        obj.raw
        for (res, _, _), obj in k8s._objects.items()
        if (res.group, res.version, res.plural) == ("", "v1", "events")
        and not obj.deleted
        and obj.raw.get("reason") == reason
    ]


async def complete(session: aiohttp.ClientSession, base: str) -> tuple[int, dict, float]:
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": MAX_TOKENS}
    started = time.monotonic()
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        return resp.status, await resp.json(), time.monotonic() - started


async def router_metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The router pod's own /metrics, unlabelled samples by name."""
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


@pytest.mark.timeout(300)
async def test_idle_goes_to_zero_and_one_request_brings_it_back(
    operator, tiny_llama_dir, tmp_path, sim_port, capsys
):
    k8s = operator.emulator
    sim = KubeletSim(KubeApi.from_environment(), NS, tmp_path / "pods", MAX_PODS, port=sim_port)
    async with sim, aiohttp.ClientSession() as session:
        # --- a new scale-to-zero service starts with one replica and answers through the router
        k8s.create_object(ISVC, inference_service(tiny_llama_dir))
        await eventually(lambda: sim.endpoints(NAME), timeout=120)
        (router,) = await eventually(lambda: sim.endpoints(ROUTER), timeout=60)
        (container,) = k8s.get(DEPLOYMENT, NS, ROUTER)["spec"]["template"]["spec"]["containers"]
        assert container["args"][container["args"].index("--activate-deployment") + 1] == NAME
        first_runtime = {p.name for p in sim.active(NAME)}
        status, body, warm_first = await complete(session, router)
        assert status == 200, body
        last_request = time.monotonic()

        # --- idle: to 0 replicas after scaleToZeroAfterSeconds, pod stopped, status says so
        await eventually(lambda: replicas(k8s) == 0, timeout=IDLE + 4 * POLL + 5)
        idle_to_zero = time.monotonic() - last_request
        assert idle_to_zero >= IDLE - POLL, f"scaled to zero {idle_to_zero:.1f}s after use"
        await eventually(lambda: not sim.active(NAME), timeout=30)
        ready = await eventually(
            lambda: (c := condition(k8s, "Ready")).get("reason") == "ScaledToZero" and c,
            timeout=10,
        )
        assert ready["status"] == "False"
        assert ready["message"] == (
            f"idle: no requests for scaleToZeroAfterSeconds ({IDLE}s); "
            "the router starts a replica on the next request"
        )
        auto = await eventually(
            lambda: (c := condition(k8s, AUTOSCALER_READY)).get("reason") == "ScaledToZero" and c,
            timeout=5,
        )
        assert auto["status"] == "True" and "activator" in auto["message"]
        (event,) = await eventually(lambda: events(k8s, "ScaledToZero"), timeout=5)
        assert f"scaleToZeroAfterSeconds {IDLE}" in event["message"]
        # The router pod stays ready (in its Service) at zero: it takes the next request.
        assert sim.endpoints(ROUTER) == [router]
        # It learns the pod is gone within a pod listing and a scrape (about a second each).
        deadline = time.monotonic() + 10
        while True:
            async with session.get(f"{router}/health") as resp:
                health = resp.status, (await resp.json())["status"]
            if "activator holds" in health[1] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert health[0] == 200 and "activator holds" in health[1], health

        # --- one request: held, 0 → 1, answered -------------------------------------
        before = {e.pod for e in sim.events}
        # (The first request may have been held too, while the new router had not yet listed
        # the first pod: that wait is in the histogram already, but no scale.)
        held_before = await router_metrics(session, router)
        sent_at = time.time()
        status, body, cold = await complete(session, router)
        assert status == 200, (
            f"{body}; Deployment replicas {replicas(k8s)}; "
            f"pods {[(e.pod, e.what, round(e.at - sent_at, 2)) for e in sim.events]}"
        )
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0
        assert replicas(k8s) == 1
        metrics = await router_metrics(session, router)
        assert held_before["kvfleet_router_cold_starts_total"] == 0
        assert metrics["kvfleet_router_cold_starts_total"] == 1
        histogram = "kvfleet_router_cold_start_seconds"
        assert metrics[f"{histogram}_count"] == held_before[f"{histogram}_count"] + 1
        ready_after = metrics[f"{histogram}_sum"] - held_before[f"{histogram}_sum"]
        status, body, warm = await complete(session, router)
        assert status == 200, body
        woke = time.monotonic()
        # The timeline of the woken pod, from the kubelet simulator's events.
        (woken,) = {e.pod for e in sim.events} - before
        at = {e.what: e.at - sent_at for e in sim.events if e.pod == woken}
        pod_started, pod_ready = at["started"], at["ready"]
        # The same start, before: the first runtime pod, from its own start to Ready.
        first = {e.what: e.at for e in sim.events if e.pod in first_runtime}
        first_start_to_ready = first["ready"] - first["started"]

        # --- the activator's replica is kept for a whole idle period, then goes -------
        await eventually(lambda: replicas(k8s) == 0, timeout=IDLE + 4 * POLL + 5)
        kept = time.monotonic() - woke
        assert kept >= IDLE - POLL, f"the woken replica went after {kept:.1f}s"
        await eventually(lambda: len(events(k8s, "ScaledToZero")) == 2, timeout=5)
        sim.raise_on_task_error()
    with capsys.disabled():
        print(
            f"\nscale to zero (kubelet sim, tiny random Llama, shared 2-core host): "
            f"idle → 0 replicas {idle_to_zero:.1f} s after the last request "
            f"(scaleToZeroAfterSeconds {IDLE}, poll {POLL} s); cold start: first request "
            f"answered in {cold:.2f} s: pod process started +{pod_started:.2f} s, pod Ready "
            f"+{pod_ready:.2f} s, router saw a ready replica +{ready_after:.2f} s; the first "
            f"pod's own start → Ready took {first_start_to_ready:.2f} s; warm requests "
            f"{warm_first:.2f} s before, {warm:.2f} s after"
        )

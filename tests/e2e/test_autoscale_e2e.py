"""Autoscaling end to end: the real operator (kopf) on the emulator, real `kvfleet serve` pods
started by the kubelet simulator, and a real request load.

The story a platform engineer would check: a load that queues requests scales 1 → ≥2 within
two polls, the added pods take traffic, and every request completes; once the load falls, replicas return to minReplicas
after the scale-down window, pods are drained (requests in flight on them complete), and the
Events and status.autoscaling say what happened.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from kube_harness import DEPLOYMENT, ISVC, eventually, isvc_with
from kvfleet.devcluster.demo.endpoint_load import EndpointLoad
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.autoscale_loop import (
    AUTOSCALER_READY,
    OBSERVERS_SETTING,
    RUNTIME_PORT_SETTING,
    PollReport,
)
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi

NS = "default"
NAME = "chat"
MAX_PODS = 4
POLL = 1  # pollIntervalSeconds
DOWN_WINDOW = 5  # scaleDownStabilizationSeconds
TARGET_QUEUE = 2
MAX_TOKENS = 300
BURST_CONCURRENCY = 12  # with --max-num-seqs 2, one pod queues ~10: far over the target


@pytest.fixture
def sim_port() -> int:
    return choose_port(pod_ips(MAX_PODS))


@pytest.fixture
def polls() -> list[PollReport]:
    return []


@pytest.fixture
def operator_registration(sim_port, polls):
    def configure(registry, config) -> None:
        config.extra[RUNTIME_PORT_SETTING] = sim_port
        config.extra[OBSERVERS_SETTING] = [polls.append]

    return configure


def inference_service(model_dir) -> dict:
    return isvc_with(
        NAME,
        model={"uri": f"file://{model_dir}", "servedName": "tiny"},
        resources={"gpus": 0, "cpu": "1", "memory": "1Gi"},
        runtime={
            "maxNumSeqs": 2,
            "maxModelLen": 512,
            "drainTimeoutSeconds": 60,
            # One thread per pod: several pods share two cores; a small KV cache is enough.
            "extraArgs": ["--num-threads", "1", "--kv-cache-memory", "1MiB"],
        },
        autoscaling={
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 3,
            "targetQueueDepth": TARGET_QUEUE,
            "pollIntervalSeconds": POLL,
            "scaleDownStabilizationSeconds": DOWN_WINDOW,
        },
    )


def events(k8s, reason: str) -> list[dict]:
    return [
        obj.raw
        for (res, _, _), obj in k8s._objects.items()
        if (res.group, res.version, res.plural) == ("", "v1", "events")
        and not obj.deleted
        and obj.raw.get("reason") == reason
    ]


def replicas(k8s) -> int:
    return k8s.get(DEPLOYMENT, NS, NAME)["spec"]["replicas"]


@pytest.mark.timeout(240)
async def test_queue_scales_up_and_idle_scales_down_with_drained_pods(
    operator, tiny_llama_dir, tmp_path, sim_port, polls
):
    k8s = operator.emulator
    api = KubeApi.from_environment()
    sim = KubeletSim(api, NS, tmp_path / "pods", max_pods=MAX_PODS, port=sim_port)
    async with sim, aiohttp.ClientSession() as session:
        k8s.create_object(ISVC, inference_service(tiny_llama_dir))
        await eventually(lambda: sim.endpoints(NAME), timeout=90)
        assert replicas(k8s) == 1

        # --- a load that queues: up within two polls, the added pods take traffic, every
        # request completes. The load lasts until an added pod has answered: a fixed number of
        # requests could all be dispatched before a new pod is ready, however fast the engine.
        load = EndpointLoad(lambda: sim.endpoints(NAME), model="tiny", max_tokens=MAX_TOKENS)
        burst_start = time.time()
        heavy_stop = asyncio.Event()
        burst = asyncio.create_task(load.steady(session, BURST_CONCURRENCY, heavy_stop))
        first_up = await eventually(
            lambda: (
                next((p for p in polls if p.scaled and p.desired > p.current), None)
                or (burst.done() and "the load ended without a scale-up")
            ),
            timeout=30,
        )
        assert isinstance(first_up, PollReport), first_up
        scaled_after = first_up.at - burst_start
        assert first_up.current == 1 and first_up.desired >= 2
        assert replicas(k8s) >= 2
        assert first_up.total_waiting / first_up.current > TARGET_QUEUE
        # The queue is there as soon as the burst starts; allow each poll its scrape timeout.
        assert scaled_after <= 2 * POLL + 2 * 1.0 + 1.0, f"scaled up after {scaled_after:.1f}s"
        try:
            await eventually(lambda: len({r.endpoint for r in load.results if r.ok}) >= 2, 90)
        except AssertionError:
            pytest.fail("the pods the autoscaler added took no traffic within 90 s")
        heavy_stop.set()
        results = await asyncio.wait_for(burst, timeout=120)
        assert len(results) >= BURST_CONCURRENCY
        failed = [r for r in results if not r.ok]
        assert not failed, f"{len(failed)} requests failed, e.g. {failed[0]}"
        assert all(r.completion_tokens == MAX_TOKENS for r in results)
        peak = replicas(k8s)
        assert peak >= 2

        # --- a light load: back to minReplicas after the window; the drain loses nothing --
        stop = asyncio.Event()
        light = asyncio.create_task(load.steady(session, concurrency=3, stop=stop))
        light_start = time.time()
        await eventually(lambda: replicas(k8s) == 1 and len(sim.pods) == 1, timeout=60)
        down_after = time.time() - light_start
        stop.set()
        light_results = await asyncio.wait_for(light, timeout=120)
        sim.raise_on_task_error()

        assert down_after >= DOWN_WINDOW - 1, "scaled down before the window passed"
        failed = [r for r in light_results if not r.ok]
        assert not failed, f"{len(failed)} requests failed during scale-down, e.g. {failed[0]}"
        stopped = [e for e in sim.events if e.what == "exited"]
        assert len(stopped) == peak - 1
        assert all(e.detail == "exit code 0" for e in stopped), stopped
        assert not [e for e in sim.events if e.what in ("crashed", "killed")]
        # The drain was exercised: the stopped pods had requests in flight at SIGTERM, and
        # those requests completed (none of the light load failed).
        drained = [e for e in sim.events if e.what == "terminating"]
        in_flight = [
            r
            for r in light_results
            for e in drained
            if r.endpoint.split("//")[1].startswith(e.ip + ":") and r.started < e.at < r.finished
        ]
        assert in_flight, "no request was in flight on a pod when it was stopped"

        # --- the story, as kubectl describe would tell it -------------------------------
        up = events(k8s, "ScaledUp")
        down = events(k8s, "ScaledDown")
        assert up and down
        assert "queue" in up[0]["message"] and "scaling 1 → " in up[0]["message"]
        assert down[-1]["message"].endswith("→ 1")
        status = await eventually(
            lambda: (
                (s := k8s.get(ISVC, NS, NAME)["status"].get("autoscaling"))
                and s.get("desiredReplicas") == 1
                and s
            )
        )
        assert status["lastScaleTime"] == down[-1]["lastTimestamp"]
        cond = find_condition(k8s.get(ISVC, NS, NAME)["status"]["conditions"], AUTOSCALER_READY)
        assert cond and cond["status"] == "True"
        assert max(p.desired for p in polls) == peak

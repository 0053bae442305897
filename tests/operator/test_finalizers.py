"""Uninstalling the operator must not strand InferenceServices: the operator puts no finalizer on
them (kopf would, were the autoscaler a kopf daemon), so `kubectl delete` works with no operator
running, and the autoscaler ends itself when its InferenceService goes."""

from __future__ import annotations

import asyncio

import pytest
from kube_harness import DEPLOYMENT, ISVC, SERVICE, eventually, isvc_with
from kvfleet.operator.autoscale_loop import AUTOSCALER_READY, OBSERVERS_SETTING
from kvfleet.operator.conditions import find_condition

NS = "default"
AUTOSCALED = {"enabled": True, "pollIntervalSeconds": 1}


def conditions(k8s, name: str) -> list[dict]:
    return ((k8s.get(ISVC, NS, name) or {}).get("status") or {}).get("conditions") or []


async def stop_operator(kube, running, config) -> None:
    """What uninstalling does to the operator: it stops (the harness's own teardown steps)."""
    running.stop.set()
    kube.emulator.close_watches()
    config.api.api_client.rest_client.pool_manager.clear()
    await eventually(lambda: not running.thread.is_alive(), timeout=15)


@pytest.mark.parametrize("autoscaling", [None, AUTOSCALED], ids=["fixed", "autoscaled"])
async def test_delete_with_no_operator_running_removes_the_inference_service(kube, autoscaling):
    from kvfleet.operator.handlers import OperatorConfig, build_registry
    from kvfleet.operator.kopf_thread import start_kopf_thread
    from kvfleet.operator.kube_api import KubeApi

    k8s = kube.emulator
    config = OperatorConfig(api=KubeApi.from_environment())
    running = start_kopf_thread(build_registry(config))
    try:
        await eventually(running.ready.is_set, timeout=15)
        spec = {"autoscaling": autoscaling} if autoscaling else {}
        k8s.create_object(ISVC, isvc_with("chat", **spec))
        await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat") and k8s.get(SERVICE, NS, "chat"))
        if autoscaling:  # the loop runs: a kopf daemon would have its finalizer by now
            await eventually(lambda: find_condition(conditions(k8s, "chat"), AUTOSCALER_READY))
        await asyncio.sleep(0.5)  # give kopf time for any write it still means to make
    finally:
        await stop_operator(kube, running, config)
    assert not k8s.get(ISVC, NS, "chat")["metadata"].get("finalizers")

    k8s.remove(ISVC, NS, "chat")
    assert k8s.get(ISVC, NS, "chat") is None, "stuck in Terminating without the operator"
    # Its children go too: ownerReferences, the garbage collector's job, not the operator's.
    assert k8s.get(DEPLOYMENT, NS, "chat") is None and k8s.get(SERVICE, NS, "chat") is None


@pytest.fixture
def polls() -> list:
    return []


@pytest.fixture
def operator_registration(polls):
    def configure(registry, config) -> None:
        config.extra[OBSERVERS_SETTING] = [polls.append]

    return configure


def requests_about(k8s, name: str) -> int:
    """API requests so far that name this InferenceService or its Deployment."""
    paths = (f"/inferenceservices/{name}", f"/deployments/{name}")
    return sum(1 for r in list(k8s) if str(r.url.path).endswith(paths))


async def test_the_autoscaler_stops_when_its_inference_service_is_deleted(operator, polls):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", autoscaling={**AUTOSCALED, "pollIntervalSeconds": 2}))
    await eventually(lambda: len(polls) >= 2, timeout=10)
    k8s.remove(ISVC, NS, "chat")
    assert k8s.get(ISVC, NS, "chat") is None  # at once: nothing holds it
    await asyncio.sleep(0.5)  # the DELETED event reaches the task set: the loop ends
    seen = requests_about(k8s, "chat")
    await asyncio.sleep(2.5)  # more than a poll interval
    assert requests_about(k8s, "chat") == seen, "the autoscaler still polls a deleted object"


async def test_a_finalizer_left_by_an_older_operator_is_removed(operator):
    # kopf's finalizer from a kvfleet that still had one: the current operator releases it.
    k8s = operator.emulator
    old = isvc_with("chat", autoscaling=AUTOSCALED)
    old["metadata"]["finalizers"] = ["kvfleet.dev/finalizer"]
    k8s.create_object(ISVC, old)
    await eventually(lambda: not k8s.get(ISVC, NS, "chat")["metadata"].get("finalizers"))
    k8s.remove(ISVC, NS, "chat")
    assert k8s.get(ISVC, NS, "chat") is None

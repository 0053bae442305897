"""kopf running the operator after an upgrade changed its default runtime image: the services
using the default move to the new image one at a time, each only once the one before has all
its replicas ready; a service naming its own image is left as it was."""

from __future__ import annotations

import asyncio
import logging

from kube_harness import DEPLOYMENT, ISVC, deployment_available, eventually, isvc_with
from kvfleet.operator.handlers import OperatorConfig, build_registry
from kvfleet.operator.image_roll import DefaultImageRolls, rolled_out
from kvfleet.operator.kopf_thread import start_kopf_thread
from kvfleet.operator.kube_api import KubeApi
from kvfleet.operator.render import render_deployment

NS = "default"
OLD, NEW = "registry.example/runtime-cpu:1", "registry.example/runtime-cpu:2"
ROLLED = ("a", "b", "c")  # gpus 0 (the sample's): the CPU default image


def image(k8s, name: str) -> str:
    return k8s.get(DEPLOYMENT, NS, name)["spec"]["template"]["spec"]["containers"][0]["image"]


def rolling(k8s) -> list[str]:
    """Services on the new image whose replicas are not all ready yet."""
    return [
        n for n in ROLLED if image(k8s, n) == NEW and not rolled_out(k8s.get(DEPLOYMENT, NS, n))
    ]


def existing_service(k8s, name: str, old_image: str, **spec) -> None:
    """An InferenceService with the Deployment an operator of the previous version applied,
    all its replicas ready."""
    isvc = k8s.create_object(ISVC, isvc_with(name, **spec))
    dep = render_deployment(isvc, old_image)
    k8s.create_object(DEPLOYMENT, dep)
    k8s.mutate(DEPLOYMENT, NS, name, deployment_available())


async def test_a_new_default_image_rolls_one_service_at_a_time(kube):
    k8s = kube.emulator
    for name in ROLLED:
        existing_service(k8s, name, OLD)
    existing_service(k8s, "pinned", "mine:7", runtime={"image": "mine:7"})
    pinned_generation = k8s.get(DEPLOYMENT, NS, "pinned")["metadata"]["generation"]

    config = OperatorConfig(
        api=KubeApi.from_environment(),
        default_runtime_cpu_image=NEW,
        rolls=DefaultImageRolls(max_at_once=1, settle_seconds=0.5),
    )
    logging.getLogger("kopf").setLevel(logging.INFO)
    running = start_kopf_thread(build_registry(config))
    try:
        await eventually(running.ready.is_set, timeout=15)
        finished: list[str] = []
        for _ in ROLLED:
            (turn,) = await eventually(lambda: rolling(k8s), timeout=15)
            # Held for as long as this one is not ready: no second service starts.
            for _ in range(10):
                await asyncio.sleep(0.1)
                assert rolling(k8s) == [turn], rolling(k8s)
            k8s.mutate(DEPLOYMENT, NS, turn, deployment_available())
            finished.append(turn)
            waiting = [n for n in ROLLED if n not in finished]
            assert all(image(k8s, n) in (OLD, NEW) for n in waiting)
        assert sorted(finished) == sorted(ROLLED)
        await eventually(lambda: all(image(k8s, n) == NEW for n in ROLLED) and not rolling(k8s))
        assert config.rolls.held() == set()
        pinned = k8s.get(DEPLOYMENT, NS, "pinned")
        assert image(k8s, "pinned") == "mine:7"
        assert pinned["metadata"]["generation"] == pinned_generation
    finally:
        running.stop.set()
        k8s.close_watches()
        config.api.api_client.rest_client.pool_manager.clear()
        await eventually(lambda: not running.thread.is_alive(), timeout=15)

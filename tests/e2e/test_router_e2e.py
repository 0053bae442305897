"""The kvfleet router end to end: the real operator (kopf) on the emulator renders the router
for an InferenceService with `spec.router.enabled`, the kubelet simulator runs it and the
runtime pods as real processes, and a request sent where the `<name>` Service points (the
router's pod) is answered by a replica; a replica added later is found by the router through
the API server, without a restart."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kube_harness import DEPLOYMENT, ISVC, POD, SERVICE, eventually, isvc_with
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.devcluster.kubelet.simulator import KubeletSim
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi

NS = "default"
NAME = "chat"
ROUTER = f"{NAME}-router"
MAX_PODS = 4


def inference_service(model_dir) -> dict:
    return isvc_with(
        NAME,
        model={"uri": f"file://{model_dir}", "servedName": "tiny"},
        resources={"gpus": 0, "cpu": "1", "memory": "1Gi"},
        replicas=2,
        runtime={
            "maxNumSeqs": 2,
            "maxModelLen": 512,
            "extraArgs": ["--num-threads", "1", "--kv-cache-memory", "1MiB"],
        },
        router={"enabled": True},
    )


async def router_health(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/health") as resp:
        return await resp.json()


async def router_reaches(
    session: aiohttp.ClientSession, url: str, replicas: list[str], timeout: float = 20.0
) -> None:
    """Wait until the router's /health lists exactly `replicas`, each healthy (it lists the
    pods about once a second and scrapes them about once a second)."""
    health: dict = {}
    for _ in range(int(timeout / 0.2)):
        health = await router_health(session, url)
        if sorted(health["replicas"]) == sorted(replicas) and set(health["replicas"].values()) == {
            "ok"
        }:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the router knows {health}, the ready pods are {replicas}")


def selected(k8s, service: str) -> set[str]:
    """The pods a Service's selector matches (what its endpoints would be)."""
    selector = k8s.get(SERVICE, NS, service)["spec"]["selector"]
    return {
        obj.raw["metadata"]["name"]
        for (res, ns, _), obj in k8s._objects.items()
        if (res.group, res.plural) == ("", "pods") and ns == NS and not obj.deleted
        and all(obj.raw["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
    }  # fmt: skip


@pytest.mark.timeout(300)
async def test_the_operator_runs_the_router_which_serves_and_finds_a_new_replica(
    operator, tiny_llama_dir, tmp_path
):
    k8s = operator.emulator
    port = choose_port(pod_ips(MAX_PODS), preferred=0)  # not 8000: other runs on the host
    sim = KubeletSim(KubeApi.from_environment(), NS, tmp_path / "pods", MAX_PODS, port=port)
    async with sim, aiohttp.ClientSession() as session:
        k8s.create_object(ISVC, inference_service(tiny_llama_dir))
        await eventually(lambda: len(sim.endpoints(NAME)) == 2, timeout=150)
        # The router is ready once it found a healthy replica through the API server.
        (router_url,) = await eventually(lambda: sim.endpoints(ROUTER), timeout=60)
        router_pods = {p.name for p in sim.active(ROUTER)}
        assert selected(k8s, NAME) == router_pods  # clients' URL leads to the router
        assert len(selected(k8s, f"{NAME}-replicas")) == 2

        body = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4}
        async with session.post(f"{router_url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["model"] == "tiny" and answer["choices"][0]["text"]
        await router_reaches(session, router_url, sim.endpoints(NAME))

        # One more replica: the router lists it from the API server and starts using it.
        k8s.mutate(ISVC, NS, NAME, lambda o: o["spec"].update(replicas=3))
        await eventually(lambda: len(sim.endpoints(NAME)) == 3, timeout=120)
        await router_reaches(session, router_url, sim.endpoints(NAME))
        async with session.post(f"{router_url}/v1/completions", json=body) as resp:
            assert resp.status == 200

        # Status: the Service's URL, Ready with a router pod ready.
        def ready() -> bool:
            status = k8s.get(ISVC, NS, NAME).get("status") or {}
            found = find_condition(status.get("conditions"), "Ready")
            return bool(found and found["status"] == "True" and status.get("router"))

        await eventually(ready, timeout=30)
        status = k8s.get(ISVC, NS, NAME)["status"]
        assert status["url"] == f"http://{NAME}.{NS}.svc.cluster.local"
        assert status["router"] == {"mode": "kvfleet", "readyReplicas": 1}
        assert (
            k8s.get(DEPLOYMENT, NS, ROUTER)["spec"]["template"]["spec"]["serviceAccountName"]
            == ROUTER
        )
        assert all(k8s.get(POD, NS, p) for p in router_pods)

"""kopf running the operator against the emulator with `spec.router`: the kvfleet router's
children come and go with the field, the Service keeps its name and follows the router, Ready
waits for a router pod, and an InferencePool on a cluster without GIE is a Degraded reason."""

from __future__ import annotations

from pathlib import Path

from kube_harness import DEPLOYMENT, ISVC, SERVICE, deployment_available, eventually, isvc_with
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.render import router_selector_labels, selector_labels

NS = "default"
SA = "v1/serviceaccounts"
ROLE = "rbac.authorization.k8s.io/v1/roles"
BINDING = "rbac.authorization.k8s.io/v1/rolebindings"
POOL = "inference.networking.k8s.io/v1/inferencepools"
POOL_CRD = Path(__file__).parent / "crds" / "inferencepools.inference.networking.k8s.io.yaml"
ROUTER_CHILDREN = [(DEPLOYMENT, "chat-router"), (SERVICE, "chat-replicas"), (SA, "chat-router"),
                   (ROLE, "chat-router"), (BINDING, "chat-router")]  # fmt: skip


def condition(k8s, type_):
    obj = k8s.get(ISVC, NS, "chat")
    found = find_condition((obj or {}).get("status", {}).get("conditions"), type_)
    return found and (found["status"], found["reason"])


def router_status(k8s):
    return ((k8s.get(ISVC, NS, "chat") or {}).get("status") or {}).get("router")


async def test_the_router_fronts_the_service_and_goes_away_when_turned_off(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", router={"enabled": True}))
    for resource, name in ROUTER_CHILDREN:
        child = await eventually(lambda r=resource, n=name: k8s.get(r, NS, n))
        assert child["metadata"]["ownerReferences"][0]["name"] == "chat"
    service = k8s.get(SERVICE, NS, "chat")
    assert service["spec"]["selector"] == router_selector_labels("chat")
    # The runtime pods' image, here the CPU one (gpus 0).
    images = {
        k8s.get(DEPLOYMENT, NS, n)["spec"]["template"]["spec"]["containers"][0]["image"]
        for n in ("chat", "chat-router")
    }
    assert images == {operator.config.default_runtime_cpu_image}
    await eventually(lambda: router_status(k8s) == {"mode": "kvfleet", "readyReplicas": 0})
    url = k8s.get(ISVC, NS, "chat")["status"]["url"]
    assert url == "http://chat.default.svc.cluster.local"  # the same URL as without a router

    # The replicas are ready, the router is not: clients could not get through yet.
    k8s.mutate(DEPLOYMENT, NS, "chat", deployment_available())
    await eventually(lambda: condition(k8s, "Ready") == ("False", "RouterNotReady"))
    k8s.mutate(DEPLOYMENT, NS, "chat-router", deployment_available())
    await eventually(lambda: condition(k8s, "Ready") == ("True", "AllReplicasReady"))
    await eventually(lambda: router_status(k8s) == {"mode": "kvfleet", "readyReplicas": 1})

    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(router={"enabled": False}))
    for resource, name in ROUTER_CHILDREN:
        await eventually(lambda r=resource, n=name: k8s.get(r, NS, n) is None)
    await eventually(
        lambda: k8s.get(SERVICE, NS, "chat")["spec"]["selector"] == selector_labels("chat")
    )
    await eventually(lambda: router_status(k8s) is None)
    assert k8s.get(DEPLOYMENT, NS, "chat") is not None  # the replicas themselves stay


async def test_an_inference_pool_without_gie_installed_is_degraded_then_made_once_it_is(
    operator,
):
    k8s = operator.emulator
    router = {"enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "chat-epp"}}
    k8s.create_object(ISVC, isvc_with("chat", router=router))
    await eventually(lambda: condition(k8s, "Degraded") == ("True", "InferencePoolAPIMissing"))
    message = find_condition(k8s.get(ISVC, NS, "chat")["status"]["conditions"], "Degraded")
    assert "inference.networking.k8s.io/v1" in message["message"]
    # Still serving through its Service meanwhile: the runtime's children are all there.
    assert k8s.get(DEPLOYMENT, NS, "chat") and k8s.get(SERVICE, NS, "chat")
    assert k8s.get(SERVICE, NS, "chat")["spec"]["selector"] == selector_labels("chat")
    assert k8s.get(DEPLOYMENT, NS, "chat-router") is None

    k8s.install_crd(POOL_CRD)  # someone installs GIE; the next reconcile makes the pool
    k8s.mutate(DEPLOYMENT, NS, "chat", deployment_available())
    pool = await eventually(lambda: k8s.get(POOL, NS, "chat"), timeout=15)
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailClose",
        "group": "", "kind": "Service",
    }  # fmt: skip
    await eventually(lambda: condition(k8s, "Degraded") == ("False", "AsExpected"))
    await eventually(lambda: router_status(k8s) == {"mode": "inferencePool"})

    # The spec change waits for the handler's recheck of the missing API (15 s at most).
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(router={"enabled": False}))
    await eventually(lambda: k8s.get(POOL, NS, "chat") is None, timeout=30)
    await eventually(lambda: router_status(k8s) is None)

"""Children are server-side applied (field manager kvfleet-operator) against the emulator's
SSA: what the spec drops leaves the Deployment, what others own stays, quantities the server
stores in canonical form never look like drift, and the autoscaler keeps spec.replicas."""

from __future__ import annotations

import asyncio

from kube_harness import DEPLOYMENT, ISVC, eventually, isvc_with
from kvfleet.operator.apply import AUTOSCALER_MANAGER, OPERATOR_MANAGER, owns
from kvfleet.operator.autoscale_poll import scale_deployment
from kvfleet.operator.handlers import reconcile
from kvfleet.operator.kube_api import DEPLOYMENTS

NS = "default"


def template(dep):
    return dep["spec"]["template"]


async def test_a_field_dropped_from_the_spec_leaves_the_deployment(operator):
    k8s, api = operator.emulator, operator.config.client()
    k8s.create_object(
        ISVC,
        isvc_with("chat", nodeSelector={"gpu": "l4"}, podAnnotations={"team": "platform"},
                  tolerations=[{"key": "gpu", "operator": "Exists"}]),
    )  # fmt: skip
    await eventually(
        lambda: (
            (d := k8s.get(DEPLOYMENT, NS, "chat"))
            and "nodeSelector" in d["spec"]["template"]["spec"]
        )
    )
    # Someone else (kubectl, another controller) annotates the Deployment under its own name.
    # (Blocking calls go to a thread: the emulator serves from this test's event loop.)
    await asyncio.to_thread(
        api.request,
        "PATCH",
        api.path(DEPLOYMENTS, NS, "chat"),
        {"metadata": {"annotations": {"owner.example/ticket": "OPS-1"}}},
        content_type="application/merge-patch+json",
        query={"fieldManager": "kubectl-annotate"},
    )
    k8s.mutate(ISVC, NS, "chat", lambda o: [o["spec"].pop(k) for k in
                                             ("nodeSelector", "podAnnotations", "tolerations")])  # fmt: skip
    dep = await eventually(
        lambda: (
            (d := k8s.get(DEPLOYMENT, NS, "chat"))
            and "nodeSelector" not in template(d)["spec"]
            and d
        )
    )
    assert "tolerations" not in template(dep)["spec"]
    assert "team" not in template(dep)["metadata"]["annotations"]
    assert dep["metadata"]["annotations"]["owner.example/ticket"] == "OPS-1"  # not ours: kept
    assert owns(dep, OPERATOR_MANAGER, ("spec", "template"))


async def test_unnormalised_quantities_never_look_like_drift(operator):
    k8s = operator.emulator
    k8s.create_object(
        ISVC, isvc_with("chat", resources={"gpus": 0, "cpu": "0.5", "memory": "1024Mi"})
    )
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    requests = template(dep)["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "500m", "memory": "1Gi"}  # as the API server stores them
    rv, asked = dep["metadata"]["resourceVersion"], len(list(k8s))
    isvc = k8s.get(ISVC, NS, "chat")
    for _ in range(3):
        await asyncio.to_thread(reconcile, operator.config, isvc)
    assert k8s.get(DEPLOYMENT, NS, "chat")["metadata"]["resourceVersion"] == rv
    # A client-side comparison saw "0.5" != "500m" and PUT the whole Deployment back each time.
    puts = [r for r in list(k8s)[asked:] if r.method == "PUT" and "/deployments/" in r.url.path]
    assert puts == []


async def test_the_autoscaler_keeps_replicas_across_applies_and_when_turned_on(operator):
    k8s, api = operator.emulator, operator.config.client()
    k8s.create_object(ISVC, isvc_with("chat", replicas=3))
    await eventually(lambda: (d := k8s.get(DEPLOYMENT, NS, "chat")) and d["spec"]["replicas"] == 3)
    # Turning autoscaling on must not drop the count to the default of one on the way.
    seen: list[int] = []
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(
        autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 6}))  # fmt: skip
    dep = await eventually(
        lambda: (
            (d := k8s.get(DEPLOYMENT, NS, "chat"))
            and seen.append(d["spec"]["replicas"]) is None
            and owns(d, AUTOSCALER_MANAGER, ("spec", "replicas"))
            and d
        )
    )
    assert dep["spec"]["replicas"] == 3 and set(seen) == {3}
    assert await asyncio.to_thread(scale_deployment, api, NS, "chat", 3, 5)  # the autoscaler
    await asyncio.to_thread(reconcile, operator.config, k8s.get(ISVC, NS, "chat"))
    assert k8s.get(DEPLOYMENT, NS, "chat")["spec"]["replicas"] == 5

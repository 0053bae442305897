"""kopf running the operator for real against the emulator: the scenarios a user would see."""

from __future__ import annotations

import time

from kube_harness import (
    DEPLOYMENT,
    ISVC,
    POD,
    SERVICE,
    deployment_available,
    eventually,
    isvc_with,
)
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.kube_api import KubeApi, KubeApiError

NS = "default"


def condition(k8s, name, type_):
    obj = k8s.get(ISVC, NS, name)
    return find_condition((obj or {}).get("status", {}).get("conditions"), type_)


async def test_create_makes_owned_children_with_the_pod_spec(operator):
    k8s = operator.emulator
    isvc = k8s.create_object(
        ISVC, isvc_with("chat", runtime={"maxNumSeqs": 9, "maxNumBatchedTokens": 512})
    )
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    svc = await eventually(lambda: k8s.get(SERVICE, NS, "chat"))
    for child in (dep, svc):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == isvc["metadata"]["uid"] and ref["controller"] is True
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "9"
    assert svc["spec"]["ports"][0]["port"] == 80
    # Status is written through the status subresource, and it never touches the spec.
    status = await eventually(
        lambda: (k8s.get(ISVC, NS, "chat") or {}).get("status", {}).get("url")
    )
    assert status == "http://chat.default.svc.cluster.local"
    assert k8s.get(ISVC, NS, "chat")["spec"] == isvc["spec"]
    assert condition(k8s, "chat", "Ready")["status"] == "False"


async def test_spec_change_rolls_the_deployment(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat"))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    k8s.mutate(
        ISVC, NS, "chat", lambda o: o["spec"].update(replicas=3, runtime={"dtype": "float32"})
    )
    dep = await eventually(
        lambda: (d := k8s.get(DEPLOYMENT, NS, "chat")) and d["spec"]["replicas"] == 3 and d
    )
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dtype") + 1] == "float32"
    assert dep["metadata"]["annotations"]["kvfleet.dev/generation"] == "2"


async def test_deleted_and_edited_children_are_restored(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat"))
    first = await eventually(lambda: k8s.get(SERVICE, NS, "chat"))
    k8s.remove(SERVICE, NS, "chat")
    again = await eventually(lambda: k8s.get(SERVICE, NS, "chat"))
    assert again["metadata"]["uid"] != first["metadata"]["uid"]  # a new object, put back

    def vandalise(dep):
        dep["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"

    k8s.mutate(DEPLOYMENT, NS, "chat", vandalise)
    await eventually(
        lambda: (
            k8s.get(DEPLOYMENT, NS, "chat")["spec"]["template"]["spec"]["containers"][0]["image"]
            == "ghcr.io/kvfleet/runtime-cpu:0.1.0"  # gpus 0: the CPU image
        )
    )
    # Restored once, then quiet: no hot loop of rewrites.
    rv = k8s.get(DEPLOYMENT, NS, "chat")["metadata"]["resourceVersion"]
    import asyncio

    await asyncio.sleep(0.5)
    assert k8s.get(DEPLOYMENT, NS, "chat")["metadata"]["resourceVersion"] == rv


async def test_available_deployment_makes_ready_true(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", replicas=2))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    k8s.mutate(DEPLOYMENT, NS, "chat", deployment_available())
    ready = await eventually(
        lambda: (c := condition(k8s, "chat", "Ready")) and c["status"] == "True" and c
    )
    status = k8s.get(ISVC, NS, "chat")["status"]
    assert ready["observedGeneration"] == status["observedGeneration"] == 1
    assert status["readyReplicas"] == 2 and status["replicas"] == 2
    assert condition(k8s, "chat", "Degraded")["status"] == "False"


async def test_ready_is_reported_even_when_status_writes_fail_for_a_while(operator, monkeypatch):
    # The Deployment's events are the only news that it became available: status writes that
    # failed then must be retried, or Ready stays False with nothing left to correct it.
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", replicas=2))
    await eventually(lambda: condition(k8s, "chat", "Ready"))
    failed: list[float] = []
    write = KubeApi.patch_preconditioned
    outage_ends = time.monotonic() + 1.5

    def failing_for_a_while(self, resource, namespace, name, compute, **kwargs):
        if kwargs.get("sub") == "status" and time.monotonic() < outage_ends:
            failed.append(time.monotonic())
            raise KubeApiError(500, "InternalError", "etcdserver: request timed out")
        return write(self, resource, namespace, name, compute, **kwargs)

    monkeypatch.setattr(KubeApi, "patch_preconditioned", failing_for_a_while)
    k8s.mutate(DEPLOYMENT, NS, "chat", deployment_available())
    await eventually(lambda: (c := condition(k8s, "chat", "Ready")) and c["status"] == "True" and c)
    assert failed and time.monotonic() >= outage_ends


async def test_crash_looping_pod_shows_degraded(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat"))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    pod = {
        "metadata": {"name": "chat-abc", "namespace": NS, "labels": {
            "app.kubernetes.io/name": "kvfleet", "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/managed-by": "kvfleet-operator"}},
        "spec": {"containers": [{"name": "runtime", "image": "x"}]},
    }  # fmt: skip
    k8s.create_object(POD, pod)
    k8s.mutate(POD, NS, "chat-abc", lambda p: p.update(status={"containerStatuses": [
        {"name": "runtime", "restartCount": 5, "ready": False, "image": "x", "imageID": "",
         "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}}]}))  # fmt: skip
    degraded = await eventually(
        lambda: (c := condition(k8s, "chat", "Degraded")) and c["status"] == "True" and c
    )
    assert degraded["reason"] == "CrashLoop" and "chat-abc" in degraded["message"]


async def test_bad_spec_is_degraded_without_children_or_crash(operator):
    k8s = operator.emulator
    # The CRD's pattern refuses s3://; an object stored before that rule existed still has it.
    bad = isvc_with("bad", model={"uri": "s3://bucket/model"})
    k8s.create_object(ISVC, bad, validate=False)
    degraded = await eventually(
        lambda: (c := condition(k8s, "bad", "Degraded")) and c["status"] == "True" and c
    )
    assert degraded["reason"] == "UnsupportedModelURI"
    assert "s3://bucket/model" in degraded["message"] and "hf://" in degraded["message"]
    assert k8s.get(DEPLOYMENT, NS, "bad") is None
    # The operator is still alive and serving others; fixing the spec recovers.
    k8s.create_object(ISVC, isvc_with("good"))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "good"))
    k8s.mutate(ISVC, NS, "bad", lambda o: o["spec"]["model"].update(uri="bundled"))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "bad"))
    await eventually(lambda: (condition(k8s, "bad", "Degraded") or {}).get("status") == "False")


async def test_too_many_gpus_is_degraded(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("big", resources={"gpus": 16}))
    degraded = await eventually(
        lambda: (c := condition(k8s, "big", "Degraded")) and c["status"] == "True" and c
    )
    assert degraded["reason"] == "InsufficientGPUs" and "16" in degraded["message"]


async def test_autoscaled_replicas_are_left_to_the_autoscaler(operator):
    k8s = operator.emulator
    auto = {"enabled": True, "minReplicas": 2, "maxReplicas": 6}
    k8s.create_object(ISVC, isvc_with("chat", replicas=1, autoscaling=auto))
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    assert dep["spec"]["replicas"] == 2  # starts at minReplicas
    k8s.mutate(DEPLOYMENT, NS, "chat", lambda d: d["spec"].update(replicas=5))  # the autoscaler
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"]["runtime"].update(maxNumSeqs=32)
               if "runtime" in o["spec"] else o["spec"].update(runtime={"maxNumSeqs": 32}))  # fmt: skip
    dep = await eventually(
        lambda: (
            (d := k8s.get(DEPLOYMENT, NS, "chat"))
            and "32" in d["spec"]["template"]["spec"]["containers"][0]["args"]
            and d
        )
    )
    assert dep["spec"]["replicas"] == 5


async def test_delete_removes_the_children(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat"))
    await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat") and k8s.get(SERVICE, NS, "chat"))
    k8s.remove(ISVC, NS, "chat")
    await eventually(lambda: k8s.get(ISVC, NS, "chat") is None)
    assert k8s.get(DEPLOYMENT, NS, "chat") is None and k8s.get(SERVICE, NS, "chat") is None
    import asyncio

    await asyncio.sleep(0.3)  # and the operator does not recreate them
    assert k8s.get(DEPLOYMENT, NS, "chat") is None


PDB = "policy/v1/poddisruptionbudgets"


async def test_a_disruption_budget_follows_the_replica_count(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", replicas=2))
    pdb = await eventually(lambda: k8s.get(PDB, NS, "chat"))
    assert pdb["spec"]["maxUnavailable"] == 1
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(replicas=1))
    # One replica: a budget could only block a node drain, so it goes.
    await eventually(lambda: k8s.get(PDB, NS, "chat") is None)

"""kopf running the operator against the emulator while the scheduler and the kubelet report
pods that cannot run: each shows as Degraded with its own reason at the pod's next event, and
goes when the pod recovers."""

from __future__ import annotations

import copy
from typing import Any

from kube_harness import DEPLOYMENT, ISVC, POD, eventually, isvc_with
from kvfleet.operator.conditions import find_condition

NS = "default"


def condition(k8s, name: str, type_: str) -> dict[str, Any] | None:
    obj = k8s.get(ISVC, NS, name)
    return find_condition((obj or {}).get("status", {}).get("conditions"), type_)


def degraded_as(k8s, name: str, status: str):
    return lambda: (c := condition(k8s, name, "Degraded")) and c["status"] == status and c


def create_pod(k8s, deployment: dict[str, Any], pod_name: str) -> None:
    """What the Deployment's ReplicaSet does: a pod from its template."""
    template = copy.deepcopy(deployment["spec"]["template"])
    metadata = {**template["metadata"], "name": pod_name, "namespace": NS}
    k8s.create_object(POD, {"metadata": metadata, "spec": template["spec"]})


async def test_a_pod_no_node_can_take_turns_the_service_degraded_and_back(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", resources={"gpus": 1}))
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    create_pod(k8s, dep, "chat-5f7c9-abcde")
    scheduler_says = (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
        "available: 3 No preemption victims found for incoming pod."
    )
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": scheduler_says, "lastTransitionTime": "2025-06-01T10:00:00Z"}
        ],
    }  # fmt: skip
    k8s.mutate(POD, NS, "chat-5f7c9-abcde", lambda p: p.update(status=unschedulable))
    cond = await eventually(degraded_as(k8s, "chat", "True"))
    assert cond["reason"] == "Unschedulable"
    assert "pod chat-5f7c9-abcde cannot be scheduled: " + scheduler_says in cond["message"]
    assert "nvidia.com/gpu 1" in cond["message"]
    assert condition(k8s, "chat", "Ready")["status"] == "False"

    # A GPU node joins; the scheduler binds the pod and the kubelet starts it.
    running = {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {"name": "runtime", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
             "state": {"running": {"startedAt": "2025-06-01T10:03:00Z"}}}
        ],
    }  # fmt: skip
    k8s.mutate(POD, NS, "chat-5f7c9-abcde", lambda p: p.update(status=running))
    cond = await eventually(degraded_as(k8s, "chat", "False"))
    assert cond["reason"] == "AsExpected"


async def test_an_image_that_cannot_be_pulled_is_degraded_with_the_image(operator):
    k8s = operator.emulator
    image = "registry.example/kvfleet/runtime:does-not-exist"
    k8s.create_object(ISVC, isvc_with("chat", runtime={"image": image}))
    dep = await eventually(lambda: k8s.get(DEPLOYMENT, NS, "chat"))
    create_pod(k8s, dep, "chat-5f7c9-fghij")
    pulling = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {"name": "runtime", "ready": False, "restartCount": 0, "image": image, "imageID": "",
             "state": {"waiting": {"reason": "ImagePullBackOff",
                                   "message": f'Back-off pulling image "{image}"'}}}
        ],
    }  # fmt: skip
    k8s.mutate(POD, NS, "chat-5f7c9-fghij", lambda p: p.update(status=pulling))
    cond = await eventually(degraded_as(k8s, "chat", "True"))
    assert cond["reason"] == "ImagePullFailed"
    assert f"cannot pull image {image}" in cond["message"]

"""The status with `spec.router`, without a server: Ready waits for a router pod, the router's
problems are Degraded reasons, and status.router says what was rendered."""

from __future__ import annotations

from kvfleet.operator.apply_router import RouterOutcome
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.spec_check import SpecProblem
from kvfleet.operator.status import compute_status

ISVC = {
    "metadata": {"name": "chat", "namespace": "ml", "generation": 4},
    "spec": {"model": {"uri": "bundled"}, "router": {"enabled": True}},
}
RUNTIME = {
    "metadata": {"generation": 1, "annotations": {"kvfleet.dev/generation": "4"}},
    "spec": {"replicas": 2},
    "status": {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2,
               "availableReplicas": 2, "readyReplicas": 2},
}  # fmt: skip


def router_deployment(ready: int) -> dict:
    return {"spec": {"replicas": 1}, "status": {"availableReplicas": ready, "readyReplicas": ready}}


def condition(status: dict, type_: str) -> tuple[str, str]:
    found = find_condition(status["conditions"], type_)
    return found["status"], found["reason"]


def test_ready_needs_a_ready_router_pod_in_front_of_ready_replicas():
    waiting = compute_status(ISVC, RUNTIME, router=RouterOutcome("kvfleet", router_deployment(0)))
    assert condition(waiting, "Ready") == ("False", "RouterNotReady")
    assert "0 of 1 router pods ready" in find_condition(waiting["conditions"], "Ready")["message"]
    assert waiting["router"] == {"mode": "kvfleet", "readyReplicas": 0}
    ready = compute_status(ISVC, RUNTIME, router=RouterOutcome("kvfleet", router_deployment(1)))
    assert condition(ready, "Ready") == ("True", "AllReplicasReady")
    assert ready["router"] == {"mode": "kvfleet", "readyReplicas": 1}
    assert ready["url"] == "http://chat.ml.svc.cluster.local"


def test_a_crash_looping_router_pod_is_degraded():
    pod = {
        "metadata": {"name": "chat-router-x"},
        "status": {"containerStatuses": [{"name": "router", "restartCount": 4,
                   "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]},
    }  # fmt: skip
    outcome = RouterOutcome("kvfleet", router_deployment(0), pods=[pod])
    status = compute_status(ISVC, RUNTIME, router=outcome)
    assert condition(status, "Degraded") == ("True", "CrashLoop")
    assert "chat-router-x" in find_condition(status["conditions"], "Degraded")["message"]


def test_a_missing_inference_pool_api_is_degraded_while_the_replicas_stay_ready():
    problem = SpecProblem("InferencePoolAPIMissing", "install GIE")
    status = compute_status(ISVC, RUNTIME, router=RouterOutcome(problem=problem))
    assert condition(status, "Degraded") == ("True", "InferencePoolAPIMissing")
    assert condition(status, "Ready") == ("True", "AllReplicasReady")


def test_status_router_goes_when_nothing_is_rendered_and_stays_when_not_reconciled():
    old = {**ISVC, "status": {"router": {"mode": "kvfleet", "readyReplicas": 1}}}
    assert compute_status(old, RUNTIME, router=RouterOutcome())["router"] is None
    # A spec the operator cannot serve: nothing was reconciled, the record stays.
    bad = compute_status(old, RUNTIME, problems=[SpecProblem("InvalidSpec", "x")])
    assert bad["router"] == {"mode": "kvfleet", "readyReplicas": 1}

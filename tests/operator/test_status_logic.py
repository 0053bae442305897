"""Conditions and status derivation, without a server."""

from __future__ import annotations

from kvfleet.operator.conditions import Condition, find_condition, merge_conditions
from kvfleet.operator.spec_check import check_spec
from kvfleet.operator.status import compute_status

ISVC = {
    "metadata": {"name": "chat", "namespace": "ml", "generation": 4},
    "spec": {"model": {"uri": "bundled"}},
}


def test_last_transition_time_moves_only_when_status_changes():
    first = merge_conditions(
        None, [Condition("Ready", "False", "Starting")], observed_generation=1, now="T1"
    )
    same = merge_conditions(
        first, [Condition("Ready", "False", "StillStarting")], observed_generation=2, now="T2"
    )
    flipped = merge_conditions(
        same, [Condition("Ready", "True", "AllReplicasReady")], observed_generation=2, now="T3"
    )
    assert find_condition(same, "Ready")["lastTransitionTime"] == "T1"
    assert find_condition(same, "Ready")["reason"] == "StillStarting"
    assert find_condition(same, "Ready")["observedGeneration"] == 2
    assert find_condition(flipped, "Ready")["lastTransitionTime"] == "T3"


def deployment(**status):
    return {
        "metadata": {"generation": 1, "annotations": {"kvfleet.dev/generation": "4"}},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, **status},
    }


def test_ready_needs_every_replica_on_the_current_spec():
    partial = compute_status(
        ISVC, deployment(replicas=2, updatedReplicas=2, availableReplicas=1, readyReplicas=1)
    )
    assert find_condition(partial["conditions"], "Ready")["status"] == "False"
    full = compute_status(
        ISVC, deployment(replicas=2, updatedReplicas=2, availableReplicas=2, readyReplicas=2)
    )
    assert find_condition(full["conditions"], "Ready")["status"] == "True"
    assert full["observedGeneration"] == 4
    stale = deployment(replicas=2, updatedReplicas=2, availableReplicas=2, readyReplicas=2)
    stale["metadata"]["annotations"]["kvfleet.dev/generation"] = "3"  # rendered from an older spec
    assert (
        find_condition(compute_status(ISVC, stale)["conditions"], "Progressing")["status"] == "True"
    )


def test_progress_deadline_is_degraded():
    dep = deployment(conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                  "message": "ReplicaSet has timed out progressing"}])  # fmt: skip
    degraded = find_condition(compute_status(ISVC, dep)["conditions"], "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ProgressDeadlineExceeded")


def test_spec_checks_name_field_and_limit():
    _, problems = check_spec(
        {"model": {"uri": "bundled"}, "resources": {"gpus": 12}}, max_gpus_per_node=8
    )
    assert [p.reason for p in problems] == ["InsufficientGPUs"]
    assert "spec.resources.gpus" in problems[0].message and "8" in problems[0].message
    _, problems = check_spec({"model": {"uri": "bundled"}, "replicas": "two"})
    assert problems[0].reason == "InvalidSpec" and "spec.replicas" in problems[0].message
    _, problems = check_spec({"model": {"uri": "file:///m", "hfTokenSecretRef": {"name": "t"}}})
    assert "hfTokenSecretRef" in problems[0].message
    assert check_spec({"model": {"uri": "hf://org/name@rev"}})[1] == []


def test_autoscaling_problems_that_leave_the_service_servable_are_not_degraded():
    model = {"uri": "bundled"}
    # min > max and prometheus without a URL cannot be served as asked: Degraded.
    _, problems = check_spec({"model": model, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}})
    assert [p.reason for p in problems] == ["InvalidSpec"]
    assert "spec.autoscaling.minReplicas (3)" in problems[0].message
    _, problems = check_spec(
        {"model": model, "autoscaling": {"enabled": True, "metricsSource": "prometheus"}}
    )
    assert "spec.autoscaling.prometheusURL is empty" in problems[0].message
    # A limit only the autoscaler needs: the pods still run; AutoscalerReady says why.
    spec, problems = check_spec({"model": model, "autoscaling": {"targetKVCacheUsage": 1.5}})
    assert problems == [] and spec is not None
    # A wrong type is a bad spec for everyone.
    _, problems = check_spec({"model": model, "autoscaling": {"maxReplicas": "4"}})
    assert "spec.autoscaling.maxReplicas: must be an integer" in problems[0].message


def test_model_cache_fields_are_checked():
    hf = "hf://org/name"
    assert check_spec({"model": {"uri": hf, "sizeHint": "16Gi", "cache": {"pvc": "c"}}})[1] == []
    for field, value in (("sizeHint", "8Gi"), ("cache", {"pvc": "c"})):
        _, problems = check_spec({"model": {"uri": "pvc://store/m", field: value}})
        assert f"spec.model.{field} is only used with hf://" in problems[0].message
    _, problems = check_spec({"model": {"uri": hf, "sizeHint": "lots"}})
    assert "spec.model.sizeHint" in problems[0].message and "16Gi" in problems[0].message
    _, problems = check_spec({"model": {"uri": hf, "sizeHint": "0"}})
    assert "spec.model.sizeHint is 0" in problems[0].message
    _, problems = check_spec({"model": {"uri": hf, "cache": {"readOnly": True}}})
    assert "spec.model.cache.pvc: is required" in problems[0].message


def pod_with_init(state: dict, last: dict | None = None) -> dict:
    init = {"name": "model-download", "state": state, "restartCount": 2}
    if last:
        init["lastState"] = {"terminated": last}
    return {"metadata": {"name": "chat-1"}, "status": {"initContainerStatuses": [init]}}


def test_failed_model_download_is_degraded_with_the_downloads_own_error():
    running = deployment(replicas=2, updatedReplicas=2, availableReplicas=0, readyReplicas=0)
    log = "Fetching 4 files\nerror: org/name is gated: set spec.model.hfTokenSecretRef\n"
    failed = pod_with_init(
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        {"exitCode": 1, "reason": "Error", "message": log},
    )
    status = compute_status(ISVC, running, [failed])
    degraded = find_condition(status["conditions"], "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelDownloadFailed")
    assert degraded["message"] == (
        "pod chat-1 init container model-download: exit code 1: "
        "Fetching 4 files / error: org/name is gated: set spec.model.hfTokenSecretRef"
    )
    # Still downloading is not a problem, and a missing Secret keeps the kubelet's reason.
    busy = pod_with_init({"running": {"startedAt": "T"}})
    degraded = find_condition(compute_status(ISVC, running, [busy])["conditions"], "Degraded")
    assert degraded["status"] == "False"
    config = pod_with_init(
        {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}
    )
    degraded = find_condition(compute_status(ISVC, running, [config])["conditions"], "Degraded")
    assert degraded["reason"] == "CreateContainerConfigError"
    assert degraded["message"].endswith('secret "hf" not found')


def test_tensor_parallel_is_served_and_degraded_only_by_gpus_or_the_runtimes_refusal():
    tp = {"model": {"uri": "bundled"}, "runtime": {"tensorParallelSize": 4}}
    assert check_spec(tp, max_gpus_per_node=8)[1] == []
    _, problems = check_spec(tp, max_gpus_per_node=2)
    assert [p.reason for p in problems] == ["InsufficientGPUs"]
    assert "needs 4 GPUs" in problems[0].message and "tensorParallelSize 4" in problems[0].message
    # The operator cannot read the model's heads; the runtime refuses a size that does not fit
    # them and the crash-looping container's log (its termination message) says why.
    log = (
        "INFO kvfleet.serve: listening on http://0.0.0.0:8000 (model bundled; /health is 503 "
        "until it is loaded)\nERROR kvfleet.serve: could not load the model: "
        "tensor_parallel_size: 4 does not fit the model's 9 attention heads and 3 KV heads; use "
        "at most 3 (whole KV-head groups per rank), or a size that divides 9 and is a multiple "
        "of 3\n"
    )
    pod = {
        "metadata": {"name": "chat-1"},
        "status": {
            "containerStatuses": [
                {
                    "name": "runtime",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": log}},
                }
            ]
        },
    }
    running = deployment(replicas=1, updatedReplicas=1, availableReplicas=0, readyReplicas=0)
    degraded = find_condition(compute_status(ISVC, running, [pod])["conditions"], "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoop")
    assert "exit code 1" in degraded["message"]
    assert "9 attention heads and 3 KV heads" in degraded["message"]

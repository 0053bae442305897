"""Pods that cannot serve, as the scheduler and the kubelet report them, each turned into the
Degraded reason and message a user reads (operator/pod_problems.py through compute_status)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvfleet.operator.conditions import find_condition
from kvfleet.operator.pod_problems import first_error, pod_problem, pods_problem
from kvfleet.operator.render import render_deployment
from kvfleet.operator.status import compute_status

ISVC = {
    "metadata": {"name": "chat", "namespace": "ml", "generation": 1, "uid": "u1"},
    "spec": {"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 1, "memory": "24Gi"}},
}
STARTING = {
    "metadata": {"generation": 1, "annotations": {"kvfleet.dev/generation": "1"}},
    "spec": {"replicas": 1},
    "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1},
}


def rendered_pod(name: str = "chat-7d9f-x2") -> dict[str, Any]:
    """A pod as its ReplicaSet creates it from the operator's own template."""
    template = copy.deepcopy(render_deployment(ISVC)["spec"]["template"])
    return {"metadata": {**template["metadata"], "name": name}, "spec": template["spec"]}


def with_status(pod: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {**pod, "status": {"phase": "Pending", **status}}


def degraded(*pods: dict[str, Any]) -> dict[str, Any]:
    status = compute_status(ISVC, STARTING, list(pods))
    return find_condition(status["conditions"], "Degraded")


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes "
    "are available: 3 No preemption victims found for incoming pod.",
}


def test_a_pod_no_node_can_take_is_unschedulable_with_the_schedulers_words():
    pod = with_status(rendered_pod(), conditions=[UNSCHEDULABLE])
    cond = degraded(pod)
    assert (cond["status"], cond["reason"]) == ("True", "Unschedulable")
    assert cond["message"].startswith("pod chat-7d9f-x2 cannot be scheduled: 0/3 nodes are")
    assert "3 Insufficient nvidia.com/gpu" in cond["message"]
    # What the pod asked for, so the reader can compare with the nodes.
    assert "nvidia.com/gpu 1" in cond["message"] and "memory 24Gi" in cond["message"]


def test_a_pod_waiting_for_a_scheduling_gate_or_just_scheduled_is_no_problem():
    gated = {**UNSCHEDULABLE, "reason": "SchedulingGated", "message": "waiting for gates"}
    assert pod_problem(with_status(rendered_pod(), conditions=[gated])) is None
    scheduled = {"type": "PodScheduled", "status": "True"}
    assert pod_problem(with_status(rendered_pod(), conditions=[scheduled])) is None


def container(name: str, waiting: dict[str, Any], last: dict[str, Any] | None = None, **kw: Any):
    cs: dict[str, Any] = {"name": name, "ready": False, "restartCount": 4, **kw}
    cs["state"] = {"waiting": waiting}
    if last is not None:
        cs["lastState"] = {"terminated": last}
    return cs


@pytest.mark.parametrize(
    "waiting",
    [
        {"reason": "ErrImagePull", "message": 'failed to pull "ghcr.io/acme/rt:9": not found'},
        {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/acme/rt:9"'},
        {"reason": "InvalidImageName", "message": 'Failed to apply default image tag "a b"'},
    ],
)
def test_an_image_that_cannot_be_pulled_is_image_pull_failed(waiting):
    cs = container("runtime", waiting, image="ghcr.io/acme/rt:9")
    cond = degraded(with_status(rendered_pod(), containerStatuses=[cs]))
    assert cond["reason"] == "ImagePullFailed"
    assert "container runtime: cannot pull image ghcr.io/acme/rt:9" in cond["message"]
    assert waiting["message"] in cond["message"]


def test_a_crash_loop_quotes_the_first_error_of_the_containers_last_log_lines():
    log = (
        "2025-06-01 10:00:01,120 INFO kvfleet.serve: listening on http://0.0.0.0:8000\n"
        "2025-06-01 10:00:09,311 ERROR kvfleet.serve: could not load the model: CUDA driver "
        "12.2 is older than this build needs (13.0)\n"
        "Traceback (most recent call last):\n"
        '  File "/app/error_handler.py", line 3, in <module>\n'
        "RuntimeError: engine core exited\n"
    )
    last = {"exitCode": 1, "reason": "Error", "message": log}
    cs = container("runtime", {"reason": "CrashLoopBackOff", "message": "back-off 40s"}, last)
    cond = degraded(with_status(rendered_pod(), phase="Running", containerStatuses=[cs]))
    assert cond["reason"] == "CrashLoop"
    assert cond["message"] == (
        "pod chat-7d9f-x2 container runtime keeps exiting (restarted 4 times), exit code 1: "
        "ERROR kvfleet.serve: could not load the model: CUDA driver 12.2 is older than this "
        "build needs (13.0)"
    )


def test_a_crash_without_an_error_line_shows_the_last_lines():
    assert first_error("loading\nweights 3/4\nSegmentation fault\n") == (
        "loading / weights 3/4 / Segmentation fault"
    )
    assert first_error("torch.OutOfMemoryError: CUDA out of memory.\n") == (
        "torch.OutOfMemoryError: CUDA out of memory."
    )


def test_an_out_of_memory_kill_names_the_memory_limit_and_the_field():
    last = {"exitCode": 137, "reason": "OOMKilled", "message": "loading weights"}
    cs = container("runtime", {"reason": "CrashLoopBackOff"}, last)
    cond = degraded(with_status(rendered_pod(), phase="Running", containerStatuses=[cs]))
    assert cond["reason"] == "OOMKilled"
    assert (
        "container runtime was killed for using more than its memory limit of 24Gi"
        in (cond["message"])
    )
    assert "spec.resources.memory" in cond["message"]


@pytest.mark.parametrize(
    "hub_error",
    [
        "kvfleet download: error: model: org/llama needs a token (401 Unauthorized from "
        "https://huggingface.co): set spec.model.hfTokenSecretRef",
        "kvfleet download: error: model: org/llama not found on https://huggingface.co (404)",
    ],
)
def test_a_failed_download_is_model_download_failed_with_the_hubs_answer(hub_error):
    last = {"exitCode": 2, "reason": "Error", "message": f"fetching files...\n{hub_error}\n"}
    init = container("model-download", {"reason": "CrashLoopBackOff"}, last)
    waiting_main = {"name": "runtime", "state": {"waiting": {"reason": "PodInitializing"}}}
    pod = with_status(
        rendered_pod(), initContainerStatuses=[init], containerStatuses=[waiting_main]
    )
    cond = degraded(pod)
    assert cond["reason"] == "ModelDownloadFailed"
    assert cond["message"] == (
        f"pod chat-7d9f-x2 init container model-download: exit code 2: fetching files... / "
        f"{hub_error}"
    )


def test_a_missing_secret_keeps_the_kubelets_reason():
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}
    cond = degraded(with_status(rendered_pod(), containerStatuses=[container("runtime", waiting)]))
    assert cond["reason"] == "CreateContainerConfigError"
    assert cond["message"].endswith('secret "hf" not found')


def test_pods_on_their_way_or_gone_are_not_problems():
    starting = container("runtime", {"reason": "ContainerCreating"})
    assert pod_problem(with_status(rendered_pod(), containerStatuses=[starting])) is None
    crashed = container("runtime", {"reason": "CrashLoopBackOff"}, {"exitCode": 1})
    evicted = with_status(rendered_pod(), phase="Failed", containerStatuses=[crashed])
    assert pod_problem(evicted) is None  # an evicted pod lingers; its replacement is what counts
    leaving = with_status(rendered_pod(), containerStatuses=[crashed])
    leaving["metadata"]["deletionTimestamp"] = "2025-06-01T10:00:00Z"
    assert pod_problem(leaving) is None
    cond = degraded(with_status(rendered_pod(), phase="Running", containerStatuses=[starting]))
    assert (cond["status"], cond["reason"]) == ("False", "AsExpected")


def test_the_first_problem_is_reported_with_how_many_pods_have_one():
    crashed = container("runtime", {"reason": "CrashLoopBackOff"}, {"exitCode": 1})
    pods = [
        with_status(rendered_pod("chat-a"), conditions=[UNSCHEDULABLE]),
        with_status(rendered_pod("chat-b"), phase="Running", containerStatuses=[crashed]),
        with_status(rendered_pod("chat-c"), conditions=[UNSCHEDULABLE]),
    ]
    problem = pods_problem(pods)
    assert problem is not None and problem.reason == "Unschedulable"
    assert problem.message.startswith("pod chat-a cannot be scheduled")
    assert problem.message.endswith("; 2 more pods cannot run either")


def test_a_vllm_flag_kvfleet_lacks_is_a_crash_loop_quoting_the_serve_error(capsys):
    """The runtime's own last stderr line for such a flag, as the kubelet keeps it, is what the
    Degraded condition says."""
    from kvfleet.runtime.cli import main

    assert main(["serve", "--swap-space", "16"]) == 2
    log = capsys.readouterr().err
    last = {"exitCode": 2, "reason": "Error", "message": log}
    cs = container("runtime", {"reason": "CrashLoopBackOff"}, last)
    cond = degraded(with_status(rendered_pod(), phase="Running", containerStatuses=[cs]))
    assert cond["reason"] == "CrashLoop"
    assert cond["message"].endswith(
        "exit code 2: kvfleet serve: error: --swap-space (preempted requests are recomputed, "
        "never swapped): kvfleet does not support this vLLM flag; remove it from the command line"
    )

"""Argo CD's view of an InferenceService: manifests/argocd/health.lua run by Lua 5.1 (as in
Argo CD's gopher-lua) on the objects the operator produces in each phase of its life."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from lupa import lua51

ARGOCD = Path(__file__).resolve().parents[2] / "manifests" / "argocd"
HEALTH_LUA = ARGOCD / "health.lua"
CM_KEY = "resource.customizations.health.kvfleet.dev_InferenceService"


def run_health(obj: dict[str, Any]) -> tuple[str, str | None]:
    """Run the script the way Argo CD does: `obj` is a global, the script returns `hs`."""
    lua = lua51.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    return hs["status"], hs["message"]


def condition(type_: str, status: str, generation: int | None = None, **extra: str) -> dict:
    c: dict[str, Any] = {"type": type_, "status": status, **extra}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def infsvc(generation: int = 2, status: dict | None = None) -> dict:
    obj: dict[str, Any] = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "default", "generation": generation},
        "spec": {"model": "bundled", "replicas": 2},
    }
    if status is not None:
        obj["status"] = status
    return obj


def test_ready_for_current_generation_is_healthy() -> None:
    status = {
        "observedGeneration": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "conditions": [
            condition("Ready", "True", 2, reason="AllReplicasReady", message="2/2 replicas ready"),
            condition("Progressing", "False", 2, reason="RolloutComplete"),
            condition("Degraded", "False", 2, reason="AsExpected"),
        ],
    }
    assert run_health(infsvc(2, status)) == ("Healthy", "2/2 replicas ready")


def test_missing_status_is_progressing() -> None:
    # A freshly synced object the operator has not seen yet must not read as Healthy or Degraded.
    state, message = run_health(infsvc(1))
    assert state == "Progressing"
    assert message


def test_status_without_conditions_is_progressing() -> None:
    assert run_health(infsvc(1, {"replicas": 0}))[0] == "Progressing"


def test_stale_observed_generation_is_progressing_even_if_ready() -> None:
    # Argo CD just synced generation 3; the Ready verdict is about generation 2.
    status = {"observedGeneration": 2, "conditions": [condition("Ready", "True", 2)]}
    state, message = run_health(infsvc(3, status))
    assert state == "Progressing"
    assert "3" in message


def test_ready_condition_for_older_generation_is_progressing() -> None:
    status = {
        "observedGeneration": 3,
        "conditions": [condition("Ready", "True", 2), condition("Progressing", "False", 3)],
    }
    assert run_health(infsvc(3, status))[0] == "Progressing"


def test_ready_falls_back_to_status_observed_generation() -> None:
    status = {"observedGeneration": 4, "conditions": [condition("Ready", "True", message="ok")]}
    assert run_health(infsvc(4, status)) == ("Healthy", "ok")


def test_ready_without_any_observed_generation_is_not_healthy() -> None:
    # Nothing says which spec was checked, so Argo CD must not call this sync healthy.
    status = {"conditions": [condition("Ready", "True")]}
    assert run_health(infsvc(1, status))[0] == "Progressing"


@pytest.mark.parametrize(
    "reason,message",
    [
        ("RollingOut", "1/2 replicas updated"),
        ("ScalingUp", "autoscaler: 2 -> 4 replicas (queue depth 37)"),
    ],
)
def test_rollout_or_scaling_is_progressing_with_its_message(reason: str, message: str) -> None:
    status = {
        "observedGeneration": 2,
        "conditions": [
            condition("Ready", "True", 2),
            condition("Progressing", "True", 2, reason=reason, message=message),
            condition("Degraded", "False", 2),
        ],
    }
    assert run_health(infsvc(2, status)) == ("Progressing", message)


def test_degraded_reports_the_operator_message() -> None:
    message = "spec.resources.gpu: 9 GPUs requested, nodes offer at most 8"
    status = {
        "observedGeneration": 2,
        "conditions": [
            condition("Ready", "False", 2, reason="InvalidSpec"),
            condition("Progressing", "False", 2),
            condition("Degraded", "True", 2, reason="InvalidSpec", message=message),
        ],
    }
    assert run_health(infsvc(2, status)) == ("Degraded", f"InvalidSpec: {message}")


def test_a_pod_that_cannot_be_scheduled_is_degraded_under_its_reason() -> None:
    # The status the operator computes for a pod the scheduler cannot place: Argo CD shows the
    # reason first, the key of docs/troubleshooting.md.
    from kvfleet.operator.status import compute_status

    isvc = infsvc(2)
    isvc["spec"] = {"model": {"uri": "bundled"}, "replicas": 1}
    deployment = {
        "metadata": {"generation": 1, "annotations": {"kvfleet.dev/generation": "2"}},
        "spec": {"replicas": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1},
    }
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}  # fmt: skip
    pod = {"metadata": {"name": "chat-x"}, "status": {"conditions": [scheduled]}}
    isvc["status"] = compute_status(isvc, deployment, [pod], now="2025-01-01T00:00:00Z")
    assert run_health(isvc) == (
        "Degraded",
        "Unschedulable: pod chat-x cannot be scheduled: 0/2 nodes are available: 2 Insufficient "
        "nvidia.com/gpu.",
    )


def test_degraded_wins_over_ready() -> None:
    status = {
        "observedGeneration": 2,
        "conditions": [
            condition("Ready", "True", 2),
            condition("Degraded", "True", 2, reason="CrashLooping", message="pod chat-0 restarts"),
        ],
    }
    assert run_health(infsvc(2, status)) == ("Degraded", "CrashLooping: pod chat-0 restarts")


def test_not_ready_and_not_progressing_is_still_progressing() -> None:
    status = {
        "observedGeneration": 1,
        "conditions": [
            condition("Ready", "False", 1, message="0/1 replicas ready"),
            condition("Progressing", "False", 1),
            condition("Degraded", "False", 1),
        ],
    }
    assert run_health(infsvc(1, status)) == ("Progressing", "0/1 replicas ready")


def scaled_to_zero(
    generation: int, autoscaling: dict | None = None, router: dict | None = None
) -> dict:
    """An InferenceService at 0 replicas (spec.replicas 0, or the autoscaler's scale to zero
    with `autoscaling`) whose Deployment has no pod left, with the status the operator itself
    computes for it."""
    from kvfleet.operator.status import compute_status

    isvc = infsvc(generation)
    isvc["spec"] = {"model": {"uri": "bundled"}, "replicas": 0}
    if autoscaling is not None:
        isvc["spec"] = {"model": {"uri": "bundled"}, "autoscaling": autoscaling, "router": router}
    deployment = {
        "metadata": {"generation": 4, "annotations": {"kvfleet.dev/generation": str(generation)}},
        "spec": {"replicas": 0},
        "status": {"observedGeneration": 4},
    }
    isvc["status"] = compute_status(isvc, deployment, now="2025-01-01T00:00:00Z")
    return isvc


def test_scaled_to_zero_is_suspended_not_progressing_forever() -> None:
    state, message = run_health(scaled_to_zero(3))
    assert state == "Suspended"
    assert "zero" in message


def test_idle_scale_to_zero_is_healthy() -> None:
    # The autoscaler removed the last replica of an idle service; the router starts one for
    # the next request: working as designed, not switched off.
    isvc = scaled_to_zero(
        3,
        {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 120},
        {"enabled": True},
    )
    ready = next(c for c in isvc["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ScaledToZero")
    state, message = run_health(isvc)
    assert state == "Healthy"
    assert message.startswith("Idle, scaled to zero") and "120s" in message


def test_zero_replicas_with_min_replicas_above_zero_stays_suspended() -> None:
    # Autoscaling on, but minReplicas 1: nothing will bring it back by itself (kubectl scale).
    isvc = scaled_to_zero(3, {"enabled": True, "minReplicas": 1}, {"enabled": True})
    assert run_health(isvc)[0] == "Suspended"


def test_idle_at_zero_without_the_router_is_suspended() -> None:
    # minReplicas 0 but no kvfleet router in front: nothing wakes it on a request.
    for router in (
        {"enabled": False},
        {"enabled": True, "mode": "inferencePool", "endpointPickerRef": {"name": "e"}},
    ):
        isvc = scaled_to_zero(3, {"enabled": True, "minReplicas": 0}, router)
        state, message = run_health(isvc)
        assert state == "Suspended" and "nothing starts one" in message


def test_scaled_to_zero_for_an_older_generation_is_progressing() -> None:
    # Scaled to zero was the verdict on generation 3; Argo CD just synced generation 4.
    isvc = scaled_to_zero(3)
    isvc["metadata"]["generation"] = 4
    assert run_health(isvc)[0] == "Progressing"


def test_argocd_cm_patch_inlines_health_lua_verbatim() -> None:
    patch = yaml.safe_load((ARGOCD / "argocd-cm-patch.yaml").read_text())
    assert patch["kind"] == "ConfigMap"
    assert patch["metadata"]["name"] == "argocd-cm"
    assert patch["data"][CM_KEY] == HEALTH_LUA.read_text()
    kubernetes_validate.validate(patch, kubernetes_validate.latest_version(), strict=True)


def test_example_application_syncs_the_samples_folder() -> None:
    app = yaml.safe_load((ARGOCD / "application.yaml").read_text())
    assert app["apiVersion"] == "argoproj.io/v1alpha1"
    assert app["kind"] == "Application"
    path = app["spec"]["source"]["path"]
    assert path == "manifests/samples"
    samples = list((ARGOCD.parents[1] / path).glob("*.yaml"))
    assert samples, f"{path}/ holds no manifests for the Application to sync"

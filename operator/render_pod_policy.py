"""The pod-policy parts of an InferenceService's children, from spec.rollout, spec.probes,
spec.securityContext and spec.disruptionBudget (pod_policy_spec.py): the Deployment's
strategy and progress deadline, the runtime container's probes, the security contexts, and
the PodDisruptionBudget's spec. Pure; at the CRD's defaults each renders what a spec without
these fields always rendered, so an operator upgrade rolls no pod."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.model_cache import plan_model_cache
from kvfleet.operator.model_uri import parse_model_uri
from kvfleet.operator.pod_policy_spec import ProbeSpec
from kvfleet.operator.spec import InferenceServiceSpec

from kvfleet import contract

PROGRESS_MARGIN_SECONDS = 600


def deployment_strategy(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Deployment's strategy: Recreate, or RollingUpdate with the spec's bounds."""
    rollout = spec.rollout
    if rollout.type == "Recreate":
        return {"type": "Recreate"}
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {
            "maxSurge": rollout.max_surge,
            "maxUnavailable": rollout.max_unavailable,
        },
    }


def _probe(probe: ProbeSpec) -> dict[str, Any]:
    return {
        "httpGet": {"path": contract.HEALTH_PATH, "port": contract.RUNTIME_PORT},
        "periodSeconds": probe.period_seconds,
        "timeoutSeconds": probe.timeout_seconds,
        "failureThreshold": probe.failure_threshold,
    }


def runtime_probes(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The runtime container's readiness, liveness and startup probes, all on /health."""
    return {
        "readinessProbe": _probe(spec.probes.readiness),
        "livenessProbe": _probe(spec.probes.liveness),
        "startupProbe": _probe(spec.probes.startup),
    }


def progress_deadline_seconds(spec: InferenceServiceSpec) -> int:
    """How long a rollout may go without progress: the startup probe's window, a margin, and
    for a model downloaded by the pods, the download at a pessimistic rate."""
    plan = plan_model_cache(spec.model, parse_model_uri(spec.model.uri))
    startup = spec.probes.startup.period_seconds * spec.probes.startup.failure_threshold
    return startup + PROGRESS_MARGIN_SECONDS + plan.download_seconds


def pod_security_context(
    spec: InferenceServiceSpec, *, fixed_uid: bool = True, volumes: bool = True
) -> dict[str, Any]:
    """The pod's securityContext: the operator's defaults, under what spec.securityContext
    sets. `fixed_uid` runs as the image's own user (its files, the cache directory, belong to
    it); without it the platform assigns UID and GID (OpenShift's restricted SCC refuses any
    outside the namespace's range). `volumes`: the pod mounts volumes it writes to (the model
    cache), so they get the pod's group."""
    context: dict[str, Any] = {"runAsNonRoot": True}
    if fixed_uid:
        context["runAsUser"] = contract.KVFLEET_UID
        context["runAsGroup"] = contract.KVFLEET_UID
        if volumes:
            context["fsGroup"] = contract.KVFLEET_UID
    if volumes:
        # A shared model cache holds many large files: no recursive chown at every start.
        context["fsGroupChangePolicy"] = "OnRootMismatch"
    context["seccompProfile"] = {"type": "RuntimeDefault"}
    context.update(spec.security_context)
    return context


def container_security_context() -> dict[str, Any]:
    """Every container's securityContext: restricted, as Pod Security's `restricted` level
    asks (not a knob: nothing kvfleet runs needs more)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def disruption_budget(spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The bound a PodDisruptionBudget sets (`{"maxUnavailable": 1}`), or None for no budget:
    switched off, or left automatic at one replica at most (a budget could then only block
    drains, or protect nothing)."""
    budget = spec.disruption_budget
    if not budget.enabled:
        return None
    if budget.max_unavailable is not None:
        return {"maxUnavailable": budget.max_unavailable}
    if budget.min_available is not None:
        return {"minAvailable": budget.min_available}
    most = spec.autoscaling.max_replicas if spec.autoscaling.enabled else spec.replicas
    return {"maxUnavailable": 1} if most > 1 else None

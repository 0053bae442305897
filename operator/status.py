"""The InferenceService status, derived (purely) from its Deployment, its pods and spec problems."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.operator import conditions as c
from kvfleet.operator.apply_router import RouterOutcome
from kvfleet.operator.lora_status import lora_problem
from kvfleet.operator.pod_problems import pods_problem
from kvfleet.operator.render import (
    DEFAULT_CLUSTER_DOMAIN,
    GENERATION_ANNOTATION,
    selector_string,
    served_name,
    service_url,
)
from kvfleet.operator.spec import SpecError, parse_spec
from kvfleet.operator.spec_check import SpecProblem


def _deployment_problem(dep_status: Mapping[str, Any]) -> c.Condition | None:
    for cond in dep_status.get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return c.Condition(
                c.DEGRADED, c.TRUE, cond.get("reason", "ReplicaFailure"), cond.get("message", "")
            )
        if (
            cond.get("type") == "Progressing"
            and cond.get("status") == "False"
            and cond.get("reason") == "ProgressDeadlineExceeded"
        ):
            return c.Condition(
                c.DEGRADED, c.TRUE, "ProgressDeadlineExceeded", cond.get("message", "")
            )
    return None


SCALED_TO_ZERO = "ScaledToZero"


def _zero_message(isvc: Mapping[str, Any]) -> str:
    """Why there are no replicas: idle under scale to zero (the next request starts one), or
    spec.replicas 0 (nothing starts one). health.lua tells them apart by the spec too."""
    try:
        spec = parse_spec(isvc.get("spec") or {})
    except SpecError:
        return "spec.replicas is 0"
    auto = spec.autoscaling
    if auto.enabled and auto.min_replicas == 0:
        idle = (
            f"idle: no requests for scaleToZeroAfterSeconds ({auto.scale_to_zero_after_seconds}s)"
        )
        if spec.router.kvfleet:
            return f"{idle}; the router starts a replica on the next request"
        return (
            f"{idle}; nothing starts one on a request: spec.router is not the kvfleet router "
            "(scale up by hand, or enable it)"
        )
    return "spec.replicas is 0"


def _router_readiness(readiness: c.Condition, deployment: Mapping[str, Any]) -> c.Condition:
    """Ready as the replicas say, unless no router pod is available to reach them through."""
    if readiness.status != c.TRUE:
        return readiness
    available = int((deployment.get("status") or {}).get("availableReplicas") or 0)
    if available > 0:
        return readiness
    want = int((deployment.get("spec") or {}).get("replicas", 1))
    return c.Condition(
        c.READY,
        c.FALSE,
        "RouterNotReady",
        f"{readiness.message}, but 0 of {want} router pods ready (the Service sends clients "
        "to the router)",
    )


def compute_status(
    isvc: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]] = (),
    problems: Sequence[SpecProblem] = (),
    *,
    now: str | None = None,
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN,
    router: RouterOutcome | None = None,
) -> dict[str, Any]:
    """The full `status` to write for an InferenceService, conditions merged with the current
    ones; `url` under the cluster's DNS domain (the router's, when one fronts the replicas:
    the same `<name>` Service). With the kvfleet router on, Ready also needs a ready router
    pod: clients reach the replicas only through it."""
    meta = isvc["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    generation = int(meta.get("generation", 0))
    old = isvc.get("status") or {}
    status: dict[str, Any] = {
        "selector": selector_string(name),
        "url": service_url(name, namespace, cluster_domain),
    }
    try:
        spec = parse_spec(isvc.get("spec") or {})
    except SpecError:
        spec = None
    status["model"] = served_name(spec, name) if spec is not None else ""
    if spec is not None and not spec.loras and "loras" in old:
        status["loras"] = None  # a merge patch's null: no adapters, no status of them
    updates: list[c.Condition]

    if problems:
        first = problems[0]
        message = "; ".join(p.message for p in problems)
        updates = [
            c.Condition(c.DEGRADED, c.TRUE, first.reason, message),
            c.Condition(
                c.PROGRESSING, c.FALSE, first.reason, "the spec cannot be served as written"
            ),
        ]
        observed = generation
        ready, replicas = 0, 0
        if deployment is not None:
            ready = int(deployment.get("status", {}).get("readyReplicas") or 0)
            replicas = int(deployment.get("status", {}).get("replicas") or 0)
        updates.append(
            c.Condition(
                c.READY,
                c.TRUE if ready > 0 else c.FALSE,
                "PreviousSpecServing" if ready > 0 else first.reason,
                "the last valid spec is still serving" if ready > 0 else message,
            )
        )
    elif deployment is None:
        observed = int(old.get("observedGeneration") or 0)
        ready = replicas = 0
        updates = [
            c.Condition(c.READY, c.FALSE, "DeploymentMissing", "the Deployment does not exist yet"),
            c.Condition(c.PROGRESSING, c.TRUE, "Creating", "creating the Deployment"),
        ]
    else:
        d_meta = deployment.get("metadata", {})
        d_status = deployment.get("status") or {}
        observed = int((d_meta.get("annotations") or {}).get(GENERATION_ANNOTATION) or 0)
        desired = int((deployment.get("spec") or {}).get("replicas", 1))
        replicas = int(d_status.get("replicas") or 0)
        ready = int(d_status.get("readyReplicas") or 0)
        available = int(d_status.get("availableReplicas") or 0)
        updated = int(d_status.get("updatedReplicas") or 0)
        seen = int(d_status.get("observedGeneration") or 0) >= int(d_meta.get("generation") or 0)
        current = observed == generation and seen
        rolled = current and updated >= desired and replicas <= updated
        if not current or not rolled:
            progress = c.Condition(
                c.PROGRESSING,
                c.TRUE,
                "RollingOut",
                f"{updated} of {desired} replicas run the current spec",
            )
        elif available < desired:
            progress = c.Condition(
                c.PROGRESSING,
                c.TRUE,
                "ReplicasStarting",
                f"{available} of {desired} replicas available",
            )
        else:
            progress = c.Condition(
                c.PROGRESSING, c.FALSE, "Complete", f"{desired} replicas run the current spec"
            )
        if desired == 0:
            readiness = c.Condition(c.READY, c.FALSE, SCALED_TO_ZERO, _zero_message(isvc))
        elif available >= desired and rolled:
            readiness = c.Condition(
                c.READY, c.TRUE, "AllReplicasReady", f"{available} of {desired} replicas ready"
            )
        elif available > 0:
            # Serving, but not everything is there yet: kubectl wait should keep waiting.
            readiness = c.Condition(
                c.READY, c.FALSE, "PartiallyReady", f"{available} of {desired} replicas ready"
            )
        else:
            readiness = c.Condition(
                c.READY, c.FALSE, "NoReplicasReady", f"0 of {desired} replicas ready"
            )
        router_pods = (router.pods or []) if router is not None else []
        pod = pods_problem([*pods, *router_pods])
        degraded = (
            c.Condition(c.DEGRADED, c.TRUE, pod.reason, pod.message)
            if pod is not None
            else _deployment_problem(d_status)
        )
        if router is not None and router.deployment is not None:
            readiness = _router_readiness(readiness, router.deployment)
        if degraded is None and router is not None and router.problem is not None:
            degraded = c.Condition(
                c.DEGRADED, c.TRUE, router.problem.reason, router.problem.message
            )
        if degraded is None and spec is not None:  # status.loras: the adapters' loop wrote it
            degraded = lora_problem(spec.loras, old.get("loras"))
        if degraded is None:
            degraded = c.Condition(c.DEGRADED, c.FALSE, "AsExpected", "")
        updates = [readiness, progress, degraded]
    if not any(u.type == c.DEGRADED for u in updates):
        updates.append(c.Condition(c.DEGRADED, c.FALSE, "AsExpected", ""))

    if router is None:
        if "router" in old:  # not reconciled this time (a bad spec): as it was
            status["router"] = old["router"]
    elif router.mode is None:
        status["router"] = None  # a merge patch's null: the key goes
    else:
        status["router"] = {"mode": router.mode}
        if router.deployment is not None:
            r_status = router.deployment.get("status") or {}
            status["router"]["readyReplicas"] = int(r_status.get("readyReplicas") or 0)
    status["observedGeneration"] = observed
    status["replicas"] = replicas
    status["readyReplicas"] = ready
    status["conditions"] = c.merge_conditions(
        old.get("conditions"), updates, observed_generation=observed, now=now
    )
    return status

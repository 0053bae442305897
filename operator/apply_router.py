"""Applying (or removing) what `spec.router` asks for: the kvfleet router's children, or an
InferencePool. Called by the reconciler after the runtime's own children.

What was rendered last is in `status.router.mode`: turning the router off (or switching
modes) deletes exactly those children, and an InferenceService that never had a router costs
no extra API call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.apply import apply_child
from kvfleet.operator.kube_api import (
    DEPLOYMENTS,
    INFERENCE_POOLS,
    PODS,
    ROLE_BINDINGS,
    ROLES,
    SERVICE_ACCOUNTS,
    SERVICES,
    KubeApi,
    KubeApiError,
)
from kvfleet.operator.render_router import (
    INFERENCE_POOL_API,
    render_inference_pool,
    render_replicas_service,
    render_router_deployment,
    render_router_role,
    render_router_role_binding,
    render_router_service_account,
    replicas_service_name,
    router_name,
)
from kvfleet.operator.spec import InferenceServiceSpec
from kvfleet.operator.spec_check import SpecProblem

# The Degraded reason when the cluster does not serve the InferencePool API.
INFERENCE_POOL_MISSING = "InferencePoolAPIMissing"


@dataclass(slots=True)
class RouterOutcome:
    """What the router part of a reconcile came to, for the status."""

    mode: str | None = None  # what is rendered now: kvfleet, inferencePool or None
    deployment: dict[str, Any] | None = None  # the router's Deployment (mode kvfleet)
    pods: list[dict[str, Any]] | None = None  # its pods, for their problems
    problem: SpecProblem | None = None


def rendered_mode(isvc: Mapping[str, Any]) -> str | None:
    """The router mode the status says was rendered last."""
    return ((isvc.get("status") or {}).get("router") or {}).get("mode")


def apply_router(
    api: KubeApi,
    isvc: Mapping[str, Any],
    spec: InferenceServiceSpec,
    default_image: str,
    *,
    fixed_uid: bool = True,
) -> RouterOutcome:
    """Make the router's children what the spec says; KubeApiError for API failures other
    than a missing InferencePool API (that becomes a Degraded problem). `default_image` and
    `fixed_uid` as for the runtime's Deployment (render.render_deployment)."""
    meta = isvc["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    before = rendered_mode(isvc)
    out = RouterOutcome()
    if spec.router.kvfleet:
        # Identity and permission first: the router's first listing must not be refused.
        apply_child(api, SERVICE_ACCOUNTS, render_router_service_account(isvc))
        apply_child(api, ROLES, render_router_role(isvc))
        apply_child(api, ROLE_BINDINGS, render_router_role_binding(isvc))
        apply_child(api, SERVICES, render_replicas_service(isvc))
        out.deployment = apply_child(
            api, DEPLOYMENTS, render_router_deployment(isvc, default_image, fixed_uid=fixed_uid)
        )
        selector = ",".join(
            f"{k}={v}" for k, v in out.deployment["spec"]["selector"]["matchLabels"].items()
        )
        out.pods = api.list(PODS, namespace, selector)
        out.mode = "kvfleet"
    elif before == "kvfleet":
        for resource, child in (
            (DEPLOYMENTS, router_name(name)),
            (SERVICES, replicas_service_name(name)),
            (ROLE_BINDINGS, router_name(name)),
            (ROLES, router_name(name)),
            (SERVICE_ACCOUNTS, router_name(name)),
        ):
            api.delete(resource, namespace, child)
    if spec.router.inference_pool:
        try:
            apply_child(api, INFERENCE_POOLS, render_inference_pool(isvc))
            out.mode = "inferencePool"
        except KubeApiError as exc:
            if exc.status != 404:
                raise
            out.problem = SpecProblem(
                INFERENCE_POOL_MISSING,
                f"the cluster does not serve {INFERENCE_POOL_API} InferencePools (install the "
                "Gateway API Inference Extension's CRDs, or set spec.router.mode: kvfleet); "
                "the replicas serve through the Service meanwhile",
            )
    elif before == "inferencePool":
        api.delete(INFERENCE_POOLS, namespace, name)  # a 404 (no pool, or no API) is fine
    return out

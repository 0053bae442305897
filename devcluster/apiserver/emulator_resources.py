"""The resources the emulator serves (discovery needs each declared): the built-in ones the
operator, kopf and the kubelet simulator use, and every CRD's own, read from the CRD file."""

from __future__ import annotations

from typing import Any

import kmock

VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}

CORE = {
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", namespaced=True, subresources={"status", "scale"}, verbs=VERBS,
    ),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, subresources={"status"}, verbs=VERBS),
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}, verbs=VERBS),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, subresources={"status"}, verbs=VERBS,
    ),
    "coordination.k8s.io/v1/leases": kmock.ResourceInfo(kind="Lease", namespaced=True, verbs=VERBS),
    # The kvfleet router's identity and its one permission (spec.router).
    "v1/serviceaccounts": kmock.ResourceInfo(kind="ServiceAccount", namespaced=True, verbs=VERBS),
    "rbac.authorization.k8s.io/v1/roles": kmock.ResourceInfo(kind="Role", namespaced=True, verbs=VERBS),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(
        kind="RoleBinding", namespaced=True, verbs=VERBS,
    ),
    # kopf's backbone: it waits for these to be discoverable before it starts watching.
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"},
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create", "list", "get"}),
    # Read by the kubelet simulator for secretKeyRef env (the operator never reads Secrets).
    "v1/secrets": kmock.ResourceInfo(kind="Secret", namespaced=True, verbs={"create", "get", "list"}),
}  # fmt: skip


def crd_resource(crd: Any) -> tuple[str, kmock.ResourceInfo]:
    """The resource path and discovery information of a CrdSchema's served version."""
    spec = crd.crd["spec"]
    names = spec["names"]
    info = kmock.ResourceInfo(
        kind=crd.kind,
        singular=names.get("singular"),
        namespaced=spec["scope"] == "Namespaced",
        subresources=set(crd.version.get("subresources") or {}),
        shortnames=set(names.get("shortNames") or []),
        categories=set(names.get("categories") or []),
        verbs=VERBS,
    )
    return f"{crd.group}/{crd.version['name']}/{crd.plural}", info

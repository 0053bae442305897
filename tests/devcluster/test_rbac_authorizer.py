"""The RBAC decisions test_rbac_coverage.py relies on: requests mapped to the attributes the API
server authorizes, and rules granted only where their bindings say."""

from __future__ import annotations

import pytest
from kvfleet.devcluster.apiserver.rbac_authorizer import (
    Access,
    Authorizer,
    NonResourceAccess,
    request_accesses,
)

SA = {"kind": "ServiceAccount", "name": "op", "namespace": "ops"}


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/apis/apps/v1/deployments", {}, Access("list", "apps", "deployments")),
        ("GET", "/apis/apps/v1/deployments", {"watch": "true"}, Access("watch", "apps", "deployments")),
        ("GET", "/api/v1/namespaces/a/pods", {"watch": "1"}, Access("watch", "", "pods", namespace="a")),
        ("GET", "/api/v1/namespaces/a/pods/p", {}, Access("get", "", "pods", namespace="a", name="p")),
        ("POST", "/api/v1/namespaces/a/events", {}, Access("create", "", "events", namespace="a")),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/a/leases/l", {},
         Access("update", "coordination.k8s.io", "leases", namespace="a", name="l")),
        ("PATCH", "/apis/kvfleet.dev/v1alpha1/namespaces/a/inferenceservices/x/status", {},
         Access("patch", "kvfleet.dev", "inferenceservices", "status", "a", "x")),
        ("DELETE", "/apis/policy/v1/namespaces/a/poddisruptionbudgets/x", {},
         Access("delete", "policy", "poddisruptionbudgets", namespace="a", name="x")),
        ("DELETE", "/api/v1/namespaces/a/pods", {}, Access("deletecollection", "", "pods", namespace="a")),
        ("GET", "/api/v1/namespaces", {"watch": "true"}, Access("watch", "", "namespaces")),
        ("GET", "/api/v1/namespaces/a", {}, Access("get", "", "namespaces", namespace="a", name="a")),
        ("GET", "/apis/apps/v1", {}, NonResourceAccess("get", "/apis/apps/v1")),
        ("GET", "/api", {}, NonResourceAccess("get", "/api")),
    ],
)  # fmt: skip
def test_requests_become_the_attributes_the_api_server_authorizes(method, path, query, expected):
    assert request_accesses(method, path, query) == [expected]


def test_an_apply_that_creates_needs_create_as_well():
    path = "/apis/apps/v1/namespaces/a/deployments/d"
    patch = Access("patch", "apps", "deployments", namespace="a", name="d")
    assert request_accesses("PATCH", path, {}) == [patch]
    assert request_accesses("PATCH", path, {}, created=True) == [
        patch,
        Access("create", "apps", "deployments", namespace="a", name="d"),
    ]


def rbac(*objects: dict) -> Authorizer:
    return Authorizer.from_objects(objects, "op", "ops")


def role(kind: str, name: str, rules: list[dict], namespace: str | None = None) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"kind": kind, "metadata": meta, "rules": rules}


def binding(kind: str, name: str, ref_kind: str, namespace: str | None = None, subject=SA) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"kind": kind, "metadata": meta, "roleRef": {"kind": ref_kind, "name": name},
            "subjects": [subject]}  # fmt: skip


PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}


def test_a_role_binding_grants_in_its_namespace_only():
    auth = rbac(role("Role", "r", [PODS], "a"), binding("RoleBinding", "r", "Role", "a"))
    assert auth.allows(Access("list", "", "pods", namespace="a"))
    assert not auth.allows(Access("list", "", "pods", namespace="b"))
    assert not auth.allows(Access("list", "", "pods"))  # all namespaces
    assert not auth.allows(Access("get", "", "pods", namespace="a", name="p"))


def test_a_cluster_role_binding_grants_everywhere_and_only_to_its_subject():
    auth = rbac(role("ClusterRole", "c", [PODS]), binding("ClusterRoleBinding", "c", "ClusterRole"))
    assert auth.allows(Access("watch", "", "pods"))
    assert auth.allows(Access("watch", "", "pods", namespace="b"))
    assert not auth.allows(Access("watch", "apps", "pods"))
    other = {**SA, "name": "someone-else"}
    stranger = rbac(
        role("ClusterRole", "c", [PODS]),
        binding("ClusterRoleBinding", "c", "ClusterRole", subject=other),
    )
    assert not stranger.allows(Access("watch", "", "pods"))
    assert stranger.unbound_roles == ["ClusterRole/c"]


def test_resource_names_and_subresources_narrow_a_rule():
    rules = [
        {"apiGroups": ["x"], "resources": ["things"], "resourceNames": ["one"], "verbs": ["get"]},
        {"apiGroups": ["x"], "resources": ["things/status"], "verbs": ["patch"]},
    ]
    auth = rbac(role("Role", "r", rules, "a"), binding("RoleBinding", "r", "Role", "a"))
    assert auth.allows(Access("get", "x", "things", namespace="a", name="one"))
    assert not auth.allows(Access("get", "x", "things", namespace="a", name="two"))
    assert auth.allows(Access("patch", "x", "things", "status", "a", "one"))
    assert not auth.allows(Access("patch", "x", "things", namespace="a", name="one"))


def test_discovery_is_allowed_to_everyone_and_nothing_else_is_unless_granted():
    auth = rbac()
    assert auth.allows(NonResourceAccess("get", "/apis/apps/v1"))
    assert not auth.allows(NonResourceAccess("get", "/metrics"))
    assert not auth.allows(Access("list", "", "pods"))


def test_unused_names_each_verb_no_request_needed():
    auth = rbac(role("Role", "r", [PODS], "a"), binding("RoleBinding", "r", "Role", "a"))
    assert auth.unused([Access("list", "", "pods", namespace="a")]) == {"Role/a/r: watch core/pods"}
    # Used in another namespace than the role's is not used by the role.
    assert auth.unused([Access("watch", "", "pods", namespace="b")]) == {
        "Role/a/r: list core/pods",
        "Role/a/r: watch core/pods",
    }

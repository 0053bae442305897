"""What Kubernetes' RBAC authorizer would decide about the requests in the emulator's log.

A request becomes the attributes the API server authorizes (k8s.io/apiserver's
RequestInfoFactory): a verb from the method, the path and the `watch` query (GET on an object
is `get`, on a collection `list` or `watch`; POST `create`, PUT `update`, PATCH `patch`,
DELETE `delete` or `deletecollection`), the API group, resource, subresource, namespace and
name. Paths outside /api/v1/… and /apis/G/V/… resources (discovery, /version) are non-resource
requests. One request may need two permissions: a server-side apply that creates its object is
authorized as `patch` by the filter and then as `create` by the patch handler
(k8s.io/apiserver/pkg/endpoints/handlers/patch.go, `createAuthorizerAttributes`).

`Authorizer` holds the rendered Roles, ClusterRoles and bindings and decides as the RBAC
authorizer does for one ServiceAccount: a ClusterRoleBinding grants its ClusterRole everywhere,
a RoleBinding grants its Role (or ClusterRole) inside the binding's namespace only, never on
cluster-scoped resources.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

# Granted to every authenticated user by the default ClusterRoles system:discovery and
# system:public-info-viewer (bound to system:authenticated): no chart needs to grant them.
DISCOVERY_URLS = (
    "/api",
    "/api/*",
    "/apis",
    "/apis/*",
    "/version",
    "/version/",
    "/healthz",
    "/livez",
    "/readyz",
    "/openapi",
    "/openapi/*",
)
NAMESPACE_SUBRESOURCES = {"status", "finalize"}
METHOD_VERBS = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}
TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # Go's strconv.ParseBool


@dataclass(frozen=True, slots=True)
class Access:
    """One authorization check for a resource request."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str | None = None  # None: a cluster-scoped resource, or all namespaces
    name: str = ""

    @property
    def combined(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else " cluster-wide"
        return f"{self.verb} {self.group or 'core'}/{self.combined}{where}"


@dataclass(frozen=True, slots=True)
class NonResourceAccess:
    """One authorization check for a non-resource URL (discovery, /version)."""

    verb: str
    path: str

    def __str__(self) -> str:
        return f"{self.verb} {self.path}"


def request_accesses(
    method: str, path: str, query: Mapping[str, str], *, created: bool = False
) -> list[Access | NonResourceAccess]:
    """The checks the API server makes for one request. `created`: the request made a new
    object (an apply answered 201)."""
    verb = METHOD_VERBS.get(method, method.lower())
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return [NonResourceAccess(verb, path)]
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch", "") in TRUE else "list"
        selected = query.get("fieldSelector", "")
        if selected.startswith("metadata.name=") and "," not in selected:
            name = selected.split("=", 1)[1]
    elif not name and verb == "delete":
        verb = "deletecollection"
    checks: list[Access | NonResourceAccess] = [
        Access(verb, group, resource, subresource, namespace, name)
    ]
    if verb == "patch" and created:
        checks.append(Access("create", group, resource, subresource, namespace, name))
    return checks


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of one rendered Role or ClusterRole, and where a binding grants it."""

    role: str  # "ClusterRole/NAME" or "Role/NAMESPACE/NAME"
    index: int
    rule: Mapping[str, Any]
    namespace: str | None  # None: granted cluster-wide (by a ClusterRoleBinding)

    def allows(self, access: Access | NonResourceAccess) -> bool:
        verbs = self.rule.get("verbs") or []
        if "*" not in verbs and access.verb not in verbs:
            return False
        if isinstance(access, NonResourceAccess):
            return self.namespace is None and any(
                u == access.path or (u.endswith("*") and access.path.startswith(u[:-1]))
                for u in self.rule.get("nonResourceURLs") or []
            )
        if self.namespace is not None and access.namespace != self.namespace:
            return False
        groups = self.rule.get("apiGroups") or []
        if "*" not in groups and access.group not in groups:
            return False
        names = self.rule.get("resourceNames") or []
        if names and access.name not in names:
            return False
        return any(
            r in ("*", access.combined) or (access.subresource and r == f"*/{access.subresource}")
            for r in self.rule.get("resources") or []
        )

    def permissions(self) -> list[tuple[str, str, str]]:
        """Each (apiGroup, resource, verb) this rule grants."""
        return [
            (group, resource, verb)
            for group in self.rule.get("apiGroups") or []
            for resource in self.rule.get("resources") or []
            for verb in self.rule.get("verbs") or []
        ]


@dataclass(slots=True)
class Authorizer:
    """The RBAC decisions for one ServiceAccount, from rendered objects."""

    rules: list[Rule]
    unbound_roles: list[str]

    @classmethod
    def from_objects(
        cls, objects: Iterable[Mapping[str, Any]], account: str, account_namespace: str
    ) -> Authorizer:
        objects = list(objects)
        roles: dict[str, Mapping[str, Any]] = {}
        for obj in objects:
            meta = obj["metadata"]
            if obj["kind"] == "ClusterRole":
                roles[f"ClusterRole/{meta['name']}"] = obj
            elif obj["kind"] == "Role":
                roles[f"Role/{meta['namespace']}/{meta['name']}"] = obj
        subject = {"kind": "ServiceAccount", "name": account, "namespace": account_namespace}
        rules: list[Rule] = []
        bound: set[str] = set()
        for obj in objects:
            if obj["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
                continue
            if not any(
                all(s.get(k) == v for k, v in subject.items()) for s in obj.get("subjects") or []
            ):
                continue
            ref = obj["roleRef"]
            namespace = obj["metadata"].get("namespace") if obj["kind"] == "RoleBinding" else None
            if ref["kind"] == "Role":
                if namespace is None:
                    continue  # a ClusterRoleBinding cannot refer to a Role
                key = f"Role/{namespace}/{ref['name']}"
            else:
                key = f"ClusterRole/{ref['name']}"
            role = roles.get(key)
            if role is None:
                continue  # a binding to nothing grants nothing
            bound.add(key)
            for index, rule in enumerate(role.get("rules") or []):
                if namespace is not None and rule.get("nonResourceURLs"):
                    continue
                rules.append(Rule(key, index, rule, namespace))
        return cls(rules, sorted(set(roles) - bound))

    def allows(self, access: Access | NonResourceAccess) -> bool:
        if isinstance(access, NonResourceAccess) and any(
            fnmatchcase(access.path, url) for url in DISCOVERY_URLS
        ):
            return access.verb == "get"
        return any(rule.allows(access) for rule in self.rules)

    def unused(self, accesses: Iterable[Access | NonResourceAccess]) -> set[str]:
        """Each granted (role, apiGroup, resource, verb) that none of `accesses` needed, as
        "ROLE: VERB GROUP/RESOURCE"."""
        needed = [a for a in accesses if isinstance(a, Access)]
        out = set()
        for rule in self.rules:
            for group, resource, verb in rule.permissions():
                narrowed = Rule(
                    rule.role,
                    rule.index,
                    {**rule.rule, "apiGroups": [group], "resources": [resource], "verbs": [verb]},
                    rule.namespace,
                )
                if not any(narrowed.allows(a) for a in needed):
                    out.add(f"{rule.role}: {verb} {group or 'core'}/{resource}")
        return out

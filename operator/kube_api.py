"""A small synchronous Kubernetes REST client returning plain dicts.

Built on the official client's configuration and transport (kubeconfig, in-cluster token,
TLS), but speaking raw JSON: the operator compares and writes whole objects as dicts, the
same shape the render functions produce, with no model-class round trip. Handlers run it in
kopf's thread pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from kvfleet import contract

DEPLOYMENTS = ("apps", "v1", "deployments")
SERVICES = ("", "v1", "services")
PODS = ("", "v1", "pods")
EVENTS = ("", "v1", "events")
SECRETS = ("", "v1", "secrets")  # read for the API key the operator loads adapters with
PDBS = ("policy", "v1", "poddisruptionbudgets")
SERVICE_ACCOUNTS = ("", "v1", "serviceaccounts")
ROLES = ("rbac.authorization.k8s.io", "v1", "roles")
ROLE_BINDINGS = ("rbac.authorization.k8s.io", "v1", "rolebindings")
INFERENCE_POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
APPLY_PATCH = "application/apply-patch+yaml"
ISVCS = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)

# What a preconditioned patch came to: written; nothing to write (or the object is gone); or
# a newer version met at every attempt (someone keeps writing: the caller retries later).
PatchOutcome = Literal["written", "unchanged", "conflict"]


class KubeApiError(Exception):
    """A non-2xx answer from the API server, with its status code and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling and server errors pass; anything else will fail the same way again."""
        return self.status in (409, 429) or self.status >= 500


@dataclass(slots=True)
class KubeApi:
    """CRUD on namespaced resources given as (group, version, plural)."""

    api_client: Any  # kubernetes.client.ApiClient

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
        import os

        import kubernetes

        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            # The client's default path is read once at its import; read KUBECONFIG now.
            path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
            kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
        return cls(kubernetes.client.ApiClient(configuration))

    @staticmethod
    def path(
        resource: tuple[str, str, str], namespace: str, name: str | None = None, sub: str = ""
    ) -> str:
        """The REST path of a collection, an object or its subresource."""
        group, version, plural = resource
        base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
        out = f"{base}/namespaces/{quote(namespace)}/{plural}"
        if name is not None:
            out += f"/{quote(name)}"
        if sub:
            out += f"/{sub}"
        return out

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """Send one request; returns the decoded JSON, None on 404, raises KubeApiError otherwise."""
        if content_type == APPLY_PATCH and body is not None:
            body = json.dumps(body)  # JSON is YAML; the client only serialises *json bodies
        params = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()) or None,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*params, _request_timeout=30)
        response.read()
        if response.status == 404 and method == "GET":
            return None
        data: dict[str, Any] = {}
        if response.data:
            try:
                data = json.loads(response.data)
            except ValueError:
                data = {"message": response.data[:500].decode(errors="replace")}
        if response.status >= 400:
            raise KubeApiError(
                response.status, str(data.get("reason", "")), str(data.get("message", ""))
            )
        return data

    def get(
        self, resource: tuple[str, str, str], namespace: str, name: str
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        return self.request("GET", self.path(resource, namespace, name))

    def list(
        self, resource: tuple[str, str, str], namespace: str, selector: str = ""
    ) -> list[dict[str, Any]]:
        """Objects in a namespace matching a label selector."""
        query = {"labelSelector": selector} if selector else None
        data = self.request("GET", self.path(resource, namespace), query=query) or {}
        return list(data.get("items") or [])

    def create(
        self, resource: tuple[str, str, str], namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """POST a new object."""
        return self.request("POST", self.path(resource, namespace), dict(body)) or {}

    def apply(
        self,
        resource: tuple[str, str, str],
        namespace: str,
        body: Mapping[str, Any],
        field_manager: str,
        *,
        force: bool = True,
    ) -> dict[str, Any]:
        """Server-side apply `body` as `field_manager`: the object becomes what this manager
        applies, and fields it applied before and no longer does go. With `force`, fields other
        managers own are taken over; without, such a field is a 409."""
        name = body["metadata"]["name"]
        query = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return (
            self.request(
                "PATCH",
                self.path(resource, namespace, name),
                dict(body),
                content_type=APPLY_PATCH,
                query=query,
            )
            or {}
        )

    def delete(self, resource: tuple[str, str, str], namespace: str, name: str) -> bool:
        """DELETE the object; False when it was already gone."""
        try:
            self.request("DELETE", self.path(resource, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def replace(
        self, resource: tuple[str, str, str], namespace: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """PUT the whole object; its metadata.resourceVersion makes a concurrent change a 409."""
        name = body["metadata"]["name"]
        return self.request("PUT", self.path(resource, namespace, name), dict(body)) or {}

    def patch_status(
        self, resource: tuple[str, str, str], namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (never the spec)."""
        return (
            self.request(
                "PATCH",
                self.path(resource, namespace, name, "status"),
                {"status": dict(status)},
                content_type="application/merge-patch+json",
            )
            or {}
        )

    def patch_preconditioned(
        self,
        resource: tuple[str, str, str],
        namespace: str,
        name: str,
        compute: Callable[[dict[str, Any]], dict[str, Any] | None],
        *,
        sub: str = "",
        current: dict[str, Any] | None = None,
        attempts: int = 3,
        field_manager: str | None = None,
    ) -> PatchOutcome:
        """Merge-patch `compute(object)` (None: nothing to write) onto the object as read, or
        as given in `current`, preconditioned on its resourceVersion: a write computed from a
        stale read is refused with 409 instead of overwriting another writer's change (a merge
        patch replaces lists such as status.conditions whole). On 409 the object is read
        again and the patch recomputed from it."""
        for _ in range(attempts):
            obj = current if current is not None else self.get(resource, namespace, name)
            current = None
            if obj is None:
                return "unchanged"
            patch = compute(obj)
            if patch is None:
                return "unchanged"
            meta = {
                **patch.get("metadata", {}),
                "resourceVersion": obj["metadata"]["resourceVersion"],
            }
            try:
                self.request(
                    "PATCH",
                    self.path(resource, namespace, name, sub),
                    {**patch, "metadata": meta},
                    content_type="application/merge-patch+json",
                    query={"fieldManager": field_manager} if field_manager else None,
                )
                return "written"
            except KubeApiError as exc:
                if exc.status == 404:
                    return "unchanged"
                if exc.status != 409:
                    raise
        return "conflict"

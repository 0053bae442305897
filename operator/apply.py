"""Children are applied with server-side apply, as field manager `kvfleet-operator`.

The API server keeps, per manager, the set of fields it applied (`metadata.managedFields`): a
field the operator applied before and no longer renders is removed (a nodeSelector dropped from
the spec leaves the Deployment), fields other managers own (the autoscaler's replicas, a
kubectl annotation) are left alone, and a re-apply of the same object changes nothing — no new
resourceVersion, so no watch event and no loop. The server also compares what it stores
(canonical quantities: `cpu: "0.5"` is stored as `500m`), which a client-side comparison got
wrong and rewrote on every event.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvfleet.operator.kube_api import KubeApi, KubeApiError

OPERATOR_MANAGER = "kvfleet-operator"
# The autoscaler's scale writes: it owns spec.replicas while autoscaling is on.
AUTOSCALER_MANAGER = "kvfleet-autoscaler"


def apply_child(
    api: KubeApi,
    resource: tuple[str, str, str],
    desired: Mapping[str, Any],
    *,
    replicas_by_autoscaler: bool = False,
) -> dict[str, Any]:
    """Make the child what `desired` says; returns the object as stored.

    With `replicas_by_autoscaler`, spec.replicas belongs to the autoscaler: the operator sets
    it only on a new object, hands it to the autoscaler's field manager, and leaves it out of
    its own applies from then on."""
    body = copy.deepcopy(dict(desired))
    if replicas_by_autoscaler:
        _hand_replicas_to_the_autoscaler(api, resource, body)
        del body["spec"]["replicas"]
    return api.apply(resource, body["metadata"]["namespace"], body, OPERATOR_MANAGER)


def _hand_replicas_to_the_autoscaler(
    api: KubeApi, resource: tuple[str, str, str], body: Mapping[str, Any]
) -> None:
    # Were the operator the only owner of spec.replicas, leaving it out of the next apply would
    # remove it (the Deployment would fall back to one replica). So the autoscaler's manager
    # first applies the current count too, and owns it from then on.
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    live = api.get(resource, namespace, name)
    if live is not None and owns(live, AUTOSCALER_MANAGER, ("spec", "replicas")):
        return
    if live is None:  # a new child starts at the rendered count (the autoscaler's floor)
        live = api.apply(resource, namespace, body, OPERATOR_MANAGER)
    replicas = {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": (live.get("spec") or {}).get("replicas", body["spec"]["replicas"])},
    }
    try:
        # Not forced: if the count changed since it was read (the autoscaler's or a person's
        # scale), someone else owns it now, which is all the hand-over needs; a forced apply
        # would put the stale count back.
        api.apply(resource, namespace, replicas, AUTOSCALER_MANAGER, force=False)
    except KubeApiError as exc:
        if exc.status != 409:
            raise


def owns(obj: Mapping[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """Whether `manager` (in any operation) owns the field at `path` of `obj`."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager:
            continue
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, Mapping) else None
        if node is not None:
            return True
    return False

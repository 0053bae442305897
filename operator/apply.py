"""Idempotent apply of rendered children: create when missing, rewrite only when drifted.

Drift means a field the operator renders has a different value live (or a list differs);
fields the server or other controllers add are left alone. A child that matches is not
written, so watching children and re-applying on every event cannot loop.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvfleet.operator.kube_api import KubeApi, KubeApiError

ATTEMPTS = 3  # a 409 means someone wrote in between: re-read and try again


def contains(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (lists: same length)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and contains(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(contains(d, v) for d, v in zip(desired, live, strict=True))
        )
    return desired == live


def overlay(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """`live` with every field of `desired` written over it (dicts merged, lists replaced)."""
    out = copy.deepcopy(dict(live))
    for key, value in desired.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = overlay(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_child(
    api: KubeApi,
    resource: tuple[str, str, str],
    desired: Mapping[str, Any],
    *,
    keep_live_replicas: bool = False,
) -> tuple[dict[str, Any], str]:
    """Make the live child match `desired`; returns (live object, "created"|"updated"|"unchanged").

    With `keep_live_replicas`, an existing object's spec.replicas is left as it is (the autoscaler
    owns it); a new object starts from the rendered value.
    """
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    for attempt in range(ATTEMPTS):
        live = api.get(resource, namespace, name)
        if live is None:
            try:
                return api.create(resource, namespace, desired), "created"
            except KubeApiError as exc:
                if exc.status == 409 and attempt < ATTEMPTS - 1:
                    continue  # created concurrently: compare against it on the next pass
                raise
        target = copy.deepcopy(dict(desired))
        if keep_live_replicas and "replicas" in (live.get("spec") or {}):
            target["spec"]["replicas"] = live["spec"]["replicas"]
        if contains(target, live):
            return live, "unchanged"
        body = overlay({k: v for k, v in live.items() if k != "status"}, target)
        body["metadata"]["resourceVersion"] = live["metadata"].get("resourceVersion")
        try:
            return api.replace(resource, namespace, body), "updated"
        except KubeApiError as exc:
            if exc.status == 409 and attempt < ATTEMPTS - 1:
                continue
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")

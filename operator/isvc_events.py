"""core/v1 Events about an InferenceService, written by the operator's loops (the autoscaler,
the LoRA adapters' loop) as `kubectl describe` lists them."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from kvfleet import contract

EVENT_MESSAGE_CHARS = 1024  # the API server's limit for an Event message


def isvc_event(
    isvc: Mapping[str, Any], type_: str, reason: str, message: str, now: str, component: str
) -> dict[str, Any]:
    """An Event of `type_` (Normal, Warning) about `isvc`, reported by kvfleet's `component`."""
    meta = isvc["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
            "kind": contract.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "reason": reason,
        "message": message[:EVENT_MESSAGE_CHARS],
        "type": type_,
        "source": {"component": f"kvfleet-{component}"},
        "reportingComponent": f"{contract.API_GROUP}/{component}",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }

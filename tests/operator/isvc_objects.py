"""InferenceService objects as the API server hands them to the operator (uid, generation),
for the render tests, and the Kubernetes version rendered objects must be valid at."""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "kvfleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1},
    "spec": {"model": {"uri": "bundled"}},
}
K8S_VERSION = "1.30"  # the chart's minimum


def isvc(**spec: Any) -> dict[str, Any]:
    """The minimal InferenceService with these spec fields set."""
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    return obj

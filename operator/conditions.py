"""Status conditions in the Kubernetes convention (metav1.Condition).

`lastTransitionTime` changes only when a condition's status changes, so `kubectl describe`
shows when something actually became true or false, not when the operator last looked.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)
TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


@dataclass(slots=True, frozen=True)
class Condition:
    """One observation: status True/False/Unknown with a CamelCase reason and a human message."""

    type: str
    status: str
    reason: str
    message: str = ""


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it: UTC, whole seconds, trailing Z."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(
    existing: Iterable[Mapping[str, Any]] | None,
    updates: Iterable[Condition],
    *,
    observed_generation: int,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Apply `updates` to `existing` conditions; keeps lastTransitionTime when status is unchanged.

    Conditions of other types (written by other controllers) are kept as they are.
    """
    stamp = now or now_rfc3339()
    result: dict[str, dict[str, Any]] = {c["type"]: dict(c) for c in existing or () if "type" in c}
    for cond in updates:
        before = result.get(cond.type)
        changed = before is None or before.get("status") != cond.status
        result[cond.type] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": stamp if changed else before.get("lastTransitionTime", stamp),
            "observedGeneration": observed_generation,
        }
    ordered = [result.pop(t) for t in CONDITION_TYPES if t in result]
    return ordered + [result[t] for t in sorted(result)]


def find_condition(
    conditions: Iterable[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    """The condition of the given type, or None."""
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None

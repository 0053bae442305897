"""How the runtime pods are replaced, probed, secured and shielded from evictions: the spec's
`rollout`, `probes`, `securityContext` and `disruptionBudget`, parsed (defaults from the CRD,
as in spec.py) and checked where the schema's own rules may be missing."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.spec_fields import SpecError, defaulted_at, object_at, value_at

ROLLOUT_TYPES = ("RollingUpdate", "Recreate")
_PERCENT = re.compile(r"^(100|[1-9]?[0-9])%$")


@dataclass(slots=True, frozen=True, kw_only=True)
class RolloutSpec:
    """`spec.rollout`: the Deployment's strategy."""

    type: str  # one of ROLLOUT_TYPES
    max_surge: int | str  # a count, or a percentage such as "25%"
    max_unavailable: int | str


@dataclass(slots=True, frozen=True, kw_only=True)
class ProbeSpec:
    """One probe's timing; each probe GETs the runtime's /health."""

    period_seconds: int
    timeout_seconds: int
    failure_threshold: int


@dataclass(slots=True, frozen=True, kw_only=True)
class ProbesSpec:
    """`spec.probes`: the runtime container's startup, readiness and liveness probes."""

    startup: ProbeSpec
    readiness: ProbeSpec
    liveness: ProbeSpec


@dataclass(slots=True, frozen=True, kw_only=True)
class DisruptionBudgetSpec:
    """`spec.disruptionBudget`: off, automatic (neither bound set), or one bound as written."""

    enabled: bool
    max_unavailable: int | str | None
    min_available: int | str | None


def _count_or_percent(raw: Mapping[str, Any], key: str, path: str) -> int | str | None:
    value = value_at(raw, key, (int, str), path)
    if isinstance(value, int) and value < 0:
        raise SpecError(f"{path}.{key}", f"must be >= 0, got {value}")
    if isinstance(value, str) and not _PERCENT.match(value):
        raise SpecError(
            f"{path}.{key}", f"must be a number or a percentage from 0% to 100%, got {value!r}"
        )
    return value


def _is_zero(value: int | str | None) -> bool:
    return value in (0, "0%")


def parse_rollout(raw: Mapping[str, Any]) -> RolloutSpec:
    """`spec.rollout` with the CRD's defaults applied; SpecError naming the field."""
    p = "spec.rollout"
    kind = defaulted_at(raw, "type", str, p)
    if kind not in ROLLOUT_TYPES:
        raise SpecError(f"{p}.type", f"must be one of {', '.join(ROLLOUT_TYPES)}, got {kind!r}")
    surge = _count_or_percent(raw, "maxSurge", p)
    unavailable = _count_or_percent(raw, "maxUnavailable", p)
    if surge is None or unavailable is None:
        raise SpecError(p, "maxSurge and maxUnavailable are required")
    if kind == "RollingUpdate" and _is_zero(surge) and _is_zero(unavailable):
        raise SpecError(
            p, "maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)"
        )
    return RolloutSpec(type=kind, max_surge=surge, max_unavailable=unavailable)


def parse_probes(raw: Mapping[str, Any]) -> ProbesSpec:
    """`spec.probes` with the CRD's defaults applied; SpecError naming the field and limit."""
    probes = {}
    for name in ("startup", "readiness", "liveness"):
        p = f"spec.probes.{name}"
        section = object_at(raw, name, "spec.probes")
        values = {
            key: defaulted_at(section, key, int, p)
            for key in ("periodSeconds", "timeoutSeconds", "failureThreshold")
        }
        for key, value in values.items():
            if value < 1:
                raise SpecError(f"{p}.{key}", f"must be >= 1, got {value}")
        probes[name] = ProbeSpec(
            period_seconds=values["periodSeconds"],
            timeout_seconds=values["timeoutSeconds"],
            failure_threshold=values["failureThreshold"],
        )
    return ProbesSpec(**probes)


def parse_disruption_budget(raw: Mapping[str, Any]) -> DisruptionBudgetSpec:
    """`spec.disruptionBudget` with the CRD's defaults applied; SpecError naming the field."""
    p = "spec.disruptionBudget"
    budget = DisruptionBudgetSpec(
        enabled=defaulted_at(raw, "enabled", bool, p),
        max_unavailable=_count_or_percent(raw, "maxUnavailable", p),
        min_available=_count_or_percent(raw, "minAvailable", p),
    )
    if budget.max_unavailable is not None and budget.min_available is not None:
        raise SpecError(p, "set maxUnavailable or minAvailable, not both")
    return budget


def parse_security_context(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`spec.securityContext` as written (the API server validates it on the Deployment);
    SpecError for root without runAsNonRoot false, which the kubelet would refuse to start."""
    context = dict(raw)
    if context.get("runAsUser") == 0 and context.get("runAsNonRoot", True):
        raise SpecError("spec.securityContext.runAsUser", "0 (root) needs runAsNonRoot: false")
    return context

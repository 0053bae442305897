"""Validation the API server does on built-in kinds that no OpenAPI schema states
(k8s.io/kubernetes pkg/apis/*/validation), per kind, for the fields the operator and its tests
write: metadata (object_meta_rules.py) and pod templates (pod_rules.py) everywhere,
Deployment selectors (present, matching the template, immutable), Service ports,
PodDisruptionBudget budgets and Lease durations. Messages follow the server's wording. Not
every rule of the API server is here: only those a write in these tests could break.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet.devcluster.apiserver.api_status import Cause, quote
from kvfleet.devcluster.apiserver.object_meta_rules import check_labels, check_metadata
from kvfleet.devcluster.apiserver.pod_rules import check_pod_spec, port_name_causes


def _selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (
            op == "NotIn" and labels.get(key) in values
        ):
            return False
        if (op == "Exists") != (key in labels) and op in ("Exists", "DoesNotExist"):
            return False
    return True


def check_deployment(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    causes = check_metadata(template, "spec.template.metadata")
    selector = spec.get("selector")
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        causes.append(Cause("spec.selector", "FieldValueRequired", "Required value"))
    else:
        causes += check_labels(selector.get("matchLabels"), "spec.selector.matchLabels")
        if not _selector_matches(selector, labels):
            causes.append(
                Cause(
                    "spec.template.metadata.labels",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(labels)}: `selector` does not match template `labels`",
                )
            )
    if old is not None and (old.get("spec") or {}).get("selector") != selector:
        causes.append(
            Cause(
                "spec.selector",
                "FieldValueInvalid",
                f"Invalid value: {quote(selector)}: field is immutable",
            )
        )
    restart = (template.get("spec") or {}).get("restartPolicy", "Always")
    if restart != "Always":
        causes.append(
            Cause(
                "spec.template.spec.restartPolicy",
                "FieldValueNotSupported",
                f'Unsupported value: {quote(restart)}: supported values: "Always"',
            )
        )
    return causes + check_pod_spec(template.get("spec") or {}, "spec.template.spec")


def check_service(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    spec = obj.get("spec") or {}
    ports = spec.get("ports") or []
    causes = []
    if (
        not ports
        and spec.get("type", "ClusterIP") != "ExternalName"
        and spec.get("clusterIP") != "None"
    ):
        causes.append(Cause("spec.ports", "FieldValueRequired", "Required value"))
    names: set[str] = set()
    for i, port in enumerate(ports):
        here = f"spec.ports[{i}]"
        if len(ports) > 1 and not port.get("name"):
            causes.append(Cause(f"{here}.name", "FieldValueRequired", "Required value"))
        elif port.get("name"):
            causes += port_name_causes(port["name"], f"{here}.name", names)
        number = port.get("port")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            causes.append(
                Cause(
                    f"{here}.port",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(number)}: must be between 1 and 65535, inclusive",
                )
            )
        target = port.get("targetPort")
        if isinstance(target, int) and not 1 <= target <= 65535:
            causes.append(
                Cause(
                    f"{here}.targetPort",
                    "FieldValueInvalid",
                    f"Invalid value: {target}: must be between 1 and 65535, inclusive",
                )
            )
        elif isinstance(target, str):
            causes += port_name_causes(target, f"{here}.targetPort", set())
    return causes


def check_pdb(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    spec = obj.get("spec") or {}
    if "minAvailable" in spec and "maxUnavailable" in spec:
        return [
            Cause(
                "spec",
                "FieldValueInvalid",
                'Invalid value: "object": minAvailable and maxUnavailable cannot be both set',
            )
        ]
    return []


def check_pod(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    return check_pod_spec(obj.get("spec") or {}, "spec")


def check_lease(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    duration = (obj.get("spec") or {}).get("leaseDurationSeconds")
    if isinstance(duration, int) and duration <= 0:
        return [
            Cause(
                "spec.leaseDurationSeconds",
                "FieldValueInvalid",
                f"Invalid value: {duration}: must be greater than 0",
            )
        ]
    return []


KIND_RULES: dict[str, Callable[[dict[str, Any], dict[str, Any] | None], list[Cause]]] = {
    "Deployment": check_deployment,
    "Service": check_service,
    "PodDisruptionBudget": check_pdb,
    "Pod": check_pod,
    "Lease": check_lease,
}


def check_builtin(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    """Every rule above that applies to `obj` (an update when `old` is given)."""
    rules = KIND_RULES.get(obj.get("kind", ""))
    return check_metadata(obj) + (rules(obj, old) if rules else [])

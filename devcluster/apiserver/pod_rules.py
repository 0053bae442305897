"""The API server's rules for pod specs (a Pod's, a Deployment's template) that no schema
states: a container needs an image and a unique DNS-1123 name, port names are IANA service
names, mounts name a volume, probes and hooks have exactly one handler, requests are not
negative and do not exceed limits (extended resources: requests equal limits)."""

from __future__ import annotations

import re
from typing import Any

from kvfleet.devcluster.apiserver.api_status import Cause, quote
from kvfleet.devcluster.apiserver.canonical_quantity import QuantityError, parse_quantity
from kvfleet.devcluster.apiserver.object_meta_rules import DNS1123_LABEL, name_error

ENV_VAR_NAME = r"[-._a-zA-Z][-._a-zA-Z0-9]*"
OVERCOMMITTABLE = {"cpu", "memory", "ephemeral-storage"}  # others need requests == limits


def _handlers(node: Any, path: str, kinds: tuple[str, ...]) -> list[Cause]:
    if not isinstance(node, dict):
        return []
    count = sum(1 for k in kinds if node.get(k) is not None)
    if count == 0:
        return [Cause(path, "FieldValueRequired", "Required value: must specify a handler type")]
    if count > 1:
        return [
            Cause(
                path, "FieldValueForbidden", "Forbidden: may not specify more than 1 handler type"
            )
        ]
    return []


def _container(c: dict[str, Any], path: str, volumes: set[str], init: bool) -> list[Cause]:
    causes = []
    name = c.get("name", "")
    if err := name_error(
        name, ("RFC 1123 label", DNS1123_LABEL, 63, "start with an alphanumeric character")
    ):
        causes.append(
            Cause(f"{path}.name", "FieldValueInvalid", f"Invalid value: {quote(name)}: {err}")
        )
    if not c.get("image"):
        causes.append(Cause(f"{path}.image", "FieldValueRequired", "Required value"))
    port_names: set[str] = set()
    for i, port in enumerate(c.get("ports") or []):
        here = f"{path}.ports[{i}]"
        number = port.get("containerPort")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            causes.append(
                Cause(
                    f"{here}.containerPort",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(number)}: must be between 1 and 65535, inclusive",
                )
            )
        if "name" in port:
            causes += port_name_causes(port["name"], f"{here}.name", port_names)
    for i, env in enumerate(c.get("env") or []):
        if not re.fullmatch(ENV_VAR_NAME, env.get("name", "")):
            causes.append(
                Cause(
                    f"{path}.env[{i}].name",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(env.get('name'))}: a valid environment variable name must consist of alphabetic characters, digits, '_', '-', or '.', and must not start with a digit",
                )
            )
    for i, mount in enumerate(c.get("volumeMounts") or []):
        if mount.get("name") not in volumes:
            causes.append(
                Cause(
                    f"{path}.volumeMounts[{i}].name",
                    "FieldValueNotFound",
                    f"Not found: {quote(mount.get('name'))}",
                )
            )
    causes += _resources(c.get("resources") or {}, f"{path}.resources")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in c and init:
            causes.append(
                Cause(
                    f"{path}.{probe}",
                    "FieldValueForbidden",
                    "Forbidden: may not be set for init containers",
                )
            )
        elif probe in c:
            causes += _handlers(
                c[probe], f"{path}.{probe}", ("exec", "httpGet", "tcpSocket", "grpc")
            )
    for hook in ("preStop", "postStart"):
        node = (c.get("lifecycle") or {}).get(hook)
        if node is not None:
            causes += _handlers(
                node, f"{path}.lifecycle.{hook}", ("exec", "httpGet", "tcpSocket", "sleep")
            )
    return causes


def port_name_causes(name: Any, path: str, seen: set[str]) -> list[Cause]:
    # IANA_SVC_NAME: at most 15 characters, lower case letters, digits and '-', one letter.
    ok = (
        isinstance(name, str)
        and 1 <= len(name) <= 15
        and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) is not None
        and "--" not in name
        and re.search(r"[a-z]", name) is not None
    )
    causes = []
    if not ok:
        causes.append(
            Cause(
                path,
                "FieldValueInvalid",
                f"Invalid value: {quote(name)}: must be no more than 15 characters, contain only lower case letters, digits and '-', and at least one letter",
            )
        )
    elif name in seen:
        causes.append(Cause(path, "FieldValueDuplicate", f"Duplicate value: {quote(name)}"))
    if isinstance(name, str):
        seen.add(name)
    return causes


def _resources(res: dict[str, Any], path: str) -> list[Cause]:
    causes = []
    values: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    for part in ("requests", "limits"):
        for name, text in (res.get(part) or {}).items():
            try:
                value = values[part][name] = parse_quantity(text)[0]
            except QuantityError:
                continue  # refused earlier, when decoding
            if value < 0:
                causes.append(
                    Cause(
                        f"{path}.{part}[{name}]",
                        "FieldValueInvalid",
                        f"Invalid value: {quote(text)}: must be greater than or equal to 0",
                    )
                )
    for name, request in values["requests"].items():
        limit = values["limits"].get(name)
        if name not in OVERCOMMITTABLE and "/" in name:
            if limit is None:
                causes.append(
                    Cause(
                        f"{path}.limits",
                        "FieldValueRequired",
                        f"Required value: Limit must be set for non overcommitable resources ({name})",
                    )
                )
            elif limit != request:
                causes.append(
                    Cause(
                        f"{path}.requests[{name}]",
                        "FieldValueInvalid",
                        f"Invalid value: {quote(res['requests'][name])}: must be equal to {name} limit of {res['limits'][name]}",
                    )
                )
        elif limit is not None and request > limit:
            causes.append(
                Cause(
                    f"{path}.requests[{name}]",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(res['requests'][name])}: must be less than or equal to {name} limit of {res['limits'][name]}",
                )
            )
    return causes


def check_pod_spec(spec: dict[str, Any], path: str) -> list[Cause]:
    causes = []
    volumes: set[str] = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        name = vol.get("name", "")
        if err := name_error(
            name, ("RFC 1123 label", DNS1123_LABEL, 63, "start with an alphanumeric character")
        ):
            causes.append(
                Cause(
                    f"{path}.volumes[{i}].name",
                    "FieldValueInvalid",
                    f"Invalid value: {quote(name)}: {err}",
                )
            )
        elif name in volumes:
            causes.append(
                Cause(
                    f"{path}.volumes[{i}].name",
                    "FieldValueDuplicate",
                    f"Duplicate value: {quote(name)}",
                )
            )
        volumes.add(name)
    if not spec.get("containers"):
        causes.append(Cause(f"{path}.containers", "FieldValueRequired", "Required value"))
    names: set[str] = set()
    for part in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(part) or []):
            here = f"{path}.{part}[{i}]"
            causes += _container(c, here, volumes, part == "initContainers")
            if c.get("name") in names:
                causes.append(
                    Cause(
                        f"{here}.name",
                        "FieldValueDuplicate",
                        f"Duplicate value: {quote(c.get('name'))}",
                    )
                )
            names.add(c.get("name"))
    grace = spec.get("terminationGracePeriodSeconds")
    if isinstance(grace, int) and grace < 0:
        causes.append(
            Cause(
                f"{path}.terminationGracePeriodSeconds",
                "FieldValueInvalid",
                f"Invalid value: {grace}: must be greater than or equal to 0",
            )
        )
    return causes

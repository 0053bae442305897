"""What the API server does to a custom resource with its CRD's structural openAPIV3Schema
before storing it: drop unknown fields (pruning), fill `default:` values, then validate —
types, required, enums, bounds, lengths, patterns, formats, list uniqueness, and the
`x-kubernetes-validations` CEL rules (transition rules with `oldSelf` on updates).
Messages follow the API server's wording (`spec.replicas: Invalid value: -1: spec.replicas in
body should be greater than or equal to 0`).

Updates ratchet as from Kubernetes 1.30: a value the update leaves unchanged (the same field,
or the same map-list item by key) is not validated again, so an object stored before a rule
existed can still have its status written. Not modelled: CEL cost limits,
`x-kubernetes-embedded-resource` metadata checks.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml
from kvfleet.devcluster.apiserver.api_status import Cause
from kvfleet.devcluster.apiserver.cel_rules import CelRule
from kvfleet.devcluster.apiserver.crd_validation import SchemaValidator

_ROOT_KEPT = ("apiVersion", "kind", "metadata")  # never pruned at the root


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class CrdSchema:
    """One served version of a CRD: its schema, with every CEL rule compiled up front (a rule
    that does not compile fails here, as the API server refuses such a CRD)."""

    def __init__(self, crd: dict[str, Any], version: str | None = None) -> None:
        self.crd = crd
        spec = crd["spec"]
        served = [v for v in spec["versions"] if v.get("served", True)]
        self.version = next(v for v in served if version in (None, v["name"]))
        self.schema: dict[str, Any] = self.version["schema"]["openAPIV3Schema"]
        self.group, self.kind = spec["group"], spec["names"]["kind"]
        self.plural = spec["names"]["plural"]
        self.rules: dict[int, list[CelRule]] = {}
        self._compile(self.schema)

    @classmethod
    def load(cls, path: pathlib.Path, version: str | None = None) -> CrdSchema:
        return cls(yaml.safe_load(path.read_text()), version)

    def _compile(self, node: Any) -> None:
        if isinstance(node, dict):
            if "x-kubernetes-validations" in node:
                self.rules[id(node)] = [
                    CelRule.compile(e) for e in node["x-kubernetes-validations"]
                ]
            for value in node.values():
                self._compile(value)
        elif isinstance(node, list):
            for value in node:
                self._compile(value)

    # --- pruning ------------------------------------------------------------------------------
    def prune(self, obj: dict[str, Any]) -> list[str]:
        """Drop fields the schema does not know (and nulls where not nullable), in place;
        returns the unknown fields' paths (what `fieldValidation=Strict` refuses)."""
        unknown: list[str] = []
        for key in list(obj):
            if key in _ROOT_KEPT:
                continue
            sub = self.schema.get("properties", {}).get(key)
            if sub is None:
                unknown.append(key)
                del obj[key]
            elif obj[key] is None and not sub.get("nullable"):
                del obj[key]
            else:
                obj[key] = self._prune(obj[key], sub, key, unknown)
        return unknown

    def _prune(self, value: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> Any:
        if isinstance(value, list) and "items" in schema:
            return [
                self._prune(v, schema["items"], f"{path}[{i}]", unknown)
                for i, v in enumerate(value)
            ]
        if not isinstance(value, dict) or schema.get("x-kubernetes-int-or-string"):
            return value
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        keep_all = schema.get("x-kubernetes-preserve-unknown-fields", False)
        out = {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is None:
                if keep_all:
                    out[key] = item
                else:
                    unknown.append(_join(path, key))
                continue
            if item is None and not sub.get("nullable"):
                continue
            out[key] = self._prune(item, sub, _join(path, key), unknown)
        return out

    # --- defaulting ---------------------------------------------------------------------------
    def default(self, obj: dict[str, Any]) -> None:
        """Fill `default:` values in place, nested ones inside defaulted objects too."""
        self._default(obj, self.schema)

    def _default(self, value: Any, schema: dict[str, Any]) -> None:
        if isinstance(value, list) and "items" in schema:
            for item in value:
                self._default(item, schema["items"])
        if not isinstance(value, dict):
            return
        for key, sub in schema.get("properties", {}).items():
            if "default" in sub and value.get(key) is None:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                self._default(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    self._default(item, extra)

    # --- validation ---------------------------------------------------------------------------
    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[Cause]:
        """Every schema and CEL violation of `obj` (an update when `old` is given)."""
        causes: list[Cause] = []
        root = {k: v for k, v in obj.items() if k != "metadata"}
        old_root = None if old is None else {k: v for k, v in old.items() if k != "metadata"}
        # CEL at the root sees metadata.name and generateName only.
        for target, source in ((root, obj), (old_root, old)):
            if target is not None and source is not None:
                meta = source.get("metadata") or {}
                target["metadata"] = {k: meta[k] for k in ("name", "generateName") if k in meta}
        SchemaValidator(self.rules).check(root, self.schema, "", old_root, causes)
        return causes

"""The built-in kinds' schemas, from the JSON schemas `kubernetes-validate` ships, at the oldest
Kubernetes version the Helm chart supports (charts/kvfleet/Chart.yaml `kubeVersion`), and a
`Shape` view of any schema node for server-side apply and quantity normalisation.

The schemas keep the Kubernetes OpenAPI list annotations (`x-kubernetes-list-type`,
`x-kubernetes-list-map-keys`, `x-kubernetes-patch-merge-key`, `x-kubernetes-map-type`), so a
list's merge behaviour comes from the same source the API server uses, not from a table here.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import pathlib
import re
from typing import Any

import jsonschema
import referencing
import yaml
from kubernetes_validate.utils import all_versions
from kvfleet.devcluster.source_checkout import CHART

QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"v?(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def chart_minimum_kubernetes(chart: pathlib.Path = CHART) -> str:
    """The oldest Kubernetes the chart claims (`kubeVersion: ">=1.27.0-0"` gives "1.27")."""
    claim = str(yaml.safe_load(chart.read_text()).get("kubeVersion", ""))
    m = re.search(r">=?\s*v?(\d+\.\d+)", claim)
    if m is None:
        raise ValueError(f"{chart}: kubeVersion {claim!r} states no minimum")
    return m[1]


def schema_version(minimum: str) -> str:
    """The oldest schema version kubernetes-validate ships that is not older than `minimum`."""
    shipped = [v for v in all_versions() if _minor(v) >= _minor(minimum)]
    if not shipped:
        raise ValueError(f"kubernetes-validate ships no schema for Kubernetes {minimum} or later")
    return shipped[0]


def _schema_dir(version: str) -> Any:
    base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    return base / f"v{version}-local-strict"


@functools.cache
def definitions(version: str) -> dict[str, Any]:
    """Every definition of that version's OpenAPI, by name (strict: no unknown fields)."""
    return json.loads((_schema_dir(version) / "_definitions.json").read_text())["$defs"]


@functools.cache
def kind_definition(version: str, api_version: str, kind: str) -> str | None:
    """The definition name of a built-in kind (None for kinds the version does not have)."""
    group, _, ver = api_version.rpartition("/")
    for name, node in definitions(version).items():
        for gvk in node.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, ver, kind):
                return name
    return None


@functools.cache
def validator(version: str, definition: str) -> jsonschema.Draft202012Validator:
    """A JSON-schema validator for one kind, its references resolved (built once per kind)."""
    defs = {"$defs": definitions(version)}
    resource = referencing.Resource.from_contents(
        defs, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource("urn:k8s-defs", resource)
    schema = {"$ref": f"urn:k8s-defs#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


class Shape:
    """One schema node as server-side apply and the quantity rules see it: the fields of an
    object, the items of a list and how the list merges (atomic, set, or map by key fields)."""

    __slots__ = ("_defs", "_node", "_root")

    def __init__(self, node: dict[str, Any] | None, defs: dict[str, Any], root: bool = False):
        self._defs, self._root = defs, root
        node = node or {}
        while "$ref" in node:  # "#/$defs/Name" or "/api/_definitions.json#/$defs/Name"
            node = defs[node["$ref"].rpartition("/")[2]]
        self._node = node

    @classmethod
    def builtin(cls, version: str, definition: str) -> Shape:
        defs = definitions(version)
        return cls(defs[definition], defs, root=True)

    @classmethod
    def custom(cls, schema: dict[str, Any], version: str) -> Shape:
        """A CRD's openAPIV3Schema; its `metadata` is ObjectMeta, as for every kind."""
        return cls(schema, definitions(version), root=True)

    def field(self, name: str) -> Shape:
        if self._root and name == "metadata":
            return Shape(self._defs[OBJECT_META], self._defs)
        props = self._node.get("properties", {})
        if name in props:
            return Shape(props[name], self._defs)
        extra = self._node.get("additionalProperties")
        return Shape(extra if isinstance(extra, dict) else None, self._defs)

    def item(self) -> Shape:
        return Shape(self._node.get("items"), self._defs)

    @property
    def list_type(self) -> str:
        """ "map" (items merged by `list_keys`), "set" (scalars, merged) or "atomic"."""
        declared = self._node.get("x-kubernetes-list-type")
        if declared:
            return declared
        if "merge" in self._node.get("x-kubernetes-patch-strategy", "").split(","):
            return "map" if "x-kubernetes-patch-merge-key" in self._node else "set"
        return "atomic"

    @property
    def list_keys(self) -> list[str]:
        keys = self._node.get("x-kubernetes-list-map-keys")
        return keys or [self._node["x-kubernetes-patch-merge-key"]]

    @property
    def atomic(self) -> bool:
        """Replaced whole, never merged: atomic maps and scalars with an object-like schema."""
        return (
            self._node.get("x-kubernetes-map-type") == "atomic"
            or bool(self._node.get("x-kubernetes-int-or-string"))
            or self.is_quantity
        )

    @property
    def is_quantity(self) -> bool:
        return self._node is self._defs.get(QUANTITY)

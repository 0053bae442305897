"""The InferenceService CRD's schema defaults, applied the way the API server applies them.

The CRD file is the one source of every spec default. The API server fills them in before the
operator sees an object; spec.py fills them in again, from the same file, so that objects stored
without them (an older CRD, a server that skips defaulting) parse the same. The operator reads
the copy of crds/inferenceservices.kvfleet.dev.yaml shipped inside its own package (`crd/`:
package data, so a wheel and the operator image carry it; tests/operator/test_crd_defaults.py
holds it to the same bytes), once, on first use.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
from collections.abc import Mapping
from typing import Any

import yaml

CRD_FILE = "inferenceservices.kvfleet.dev.yaml"
PACKAGED_CRD = ("kvfleet.operator", "crd", CRD_FILE)  # (package, folder, file)

# libyaml's loader when PyYAML was built with it: the CRD is read once per process, but the
# pure-Python loader takes several times longer over its 800 lines.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def packaged_crd_text() -> str:
    """The CRD as shipped with the operator."""
    package, folder, name = PACKAGED_CRD
    return importlib.resources.files(package).joinpath(folder, name).read_text(encoding="utf-8")


def spec_schema_of(crd_text: str) -> dict[str, Any]:
    """The openAPIV3Schema of `spec` in a CRD's storage version."""
    crd = yaml.load(crd_text, Loader=_LOADER)
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


@functools.cache
def spec_schema() -> Mapping[str, Any]:
    """The packaged CRD's `spec` schema, read on first use and kept (callers must not change it)."""
    return spec_schema_of(packaged_crd_text())


def section_schema(schema: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """The schema of one `spec` field, e.g. "autoscaling"."""
    return schema["properties"][name]


def apply_defaults(value: Any, schema: Mapping[str, Any]) -> Any:
    """A copy of `value` with the schema's defaults filled in, as Kubernetes' structural
    defaulting does: in an object, a property's default applies where the key is absent, or
    null in a property that is not nullable (the server prunes such a null first); then every property present, defaulted ones
    included, is defaulted by its own schema, map values by `additionalProperties` and list
    items by `items`. Values of the wrong type are returned as they are, for the parser to
    name the field."""
    if isinstance(value, Mapping):
        props: Mapping[str, Any] = schema.get("properties") or {}
        out = dict(value)
        for key, prop in props.items():
            absent = key not in out or (out[key] is None and not prop.get("nullable"))
            if absent and "default" in prop:
                out[key] = copy.deepcopy(prop["default"])
        extra = schema.get("additionalProperties")
        for key, item in out.items():
            if key in props:
                out[key] = apply_defaults(item, props[key])
            elif isinstance(extra, Mapping):
                out[key] = apply_defaults(item, extra)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value

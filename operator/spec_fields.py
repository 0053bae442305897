"""Reading one typed field of a raw InferenceService spec: the type checks every parser in
spec.py shares, and SpecError naming the field's dotted path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SpecError(ValueError):
    """A spec field is missing or has the wrong type or value; `field` is its dotted path (e.g.
    spec.runtime.blockSize)."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


def object_at(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    """The object at `key` ({} when absent or null), or SpecError when it is not an object."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", f"must be an object, got {type(value).__name__}")
    return value


def value_at(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    """The value at `key` (None when absent or null), or SpecError when it has the wrong type."""
    value = raw.get(key)
    if value is None:
        return None
    # bool is an int in Python; a YAML `true` where a number belongs is still a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SpecError(f"{path}.{key}", f"must be {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise SpecError(f"{path}.{key}", f"must be {_kind_name(kind)}, got {value!r}")
    return value


def defaulted_at(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    """A field the CRD gives a default, so present once defaults are applied; SpecError "is
    required" should the CRD ever stop defaulting it."""
    value = value_at(raw, key, kind, path)
    if value is None:
        raise SpecError(f"{path}.{key}", "is required")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "a list",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def quantity_at(raw: Mapping[str, Any], key: str, path: str) -> str | None:
    """A Kubernetes quantity (int-or-string in the schema) as a string; None when absent."""
    value = value_at(raw, key, (str, int, float), path)
    return None if value is None else str(value)


def defaulted_quantity_at(raw: Mapping[str, Any], key: str, path: str) -> str:
    """A quantity the CRD gives a default, as a string."""
    return str(defaulted_at(raw, key, (str, int, float), path))


def strings_at(raw: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    """A list of strings (empty when absent), or SpecError naming the field."""
    items = value_at(raw, key, list, path) or []
    if not all(isinstance(a, str) for a in items):
        raise SpecError(f"{path}.{key}", "must be a list of strings")
    return tuple(items)

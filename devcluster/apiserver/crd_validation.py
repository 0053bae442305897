"""Validation of a custom resource against its CRD's structural schema, as the API server
words it: types, required, enums, bounds, lengths, patterns, formats, list uniqueness, and the
compiled `x-kubernetes-validations` CEL rules (crd_schema.py compiles them; this runs them)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import re
import uuid
from typing import Any

from kvfleet.devcluster.apiserver.api_status import Cause, quote
from kvfleet.devcluster.apiserver.cel_rules import CelRule

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _type_ok(value: Any, type_: str) -> bool:
    if isinstance(value, bool):
        return type_ == "boolean"
    if type_ == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[type_])


def _format_ok(value: str, fmt: str) -> bool:
    """The string formats the API server checks (others, like int32 on strings, pass)."""
    try:
        if fmt == "date-time":
            if not re.fullmatch(
                r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value
            ):
                return False
            datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        elif fmt == "date":
            datetime.date.fromisoformat(value)
        elif fmt == "uuid":
            uuid.UUID(value)
        elif fmt == "byte":
            base64.b64decode(value, validate=True)
        elif fmt == "ipv4":
            ipaddress.IPv4Address(value)
        elif fmt == "ipv6":
            ipaddress.IPv6Address(value)
        elif fmt == "duration":
            return bool(re.fullmatch(r"([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+|0", value))
    except ValueError:
        return False
    return True


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _list_key(item: Any, keys: list[str]) -> tuple[Any, ...]:
    return tuple(repr(item.get(k)) for k in keys) if isinstance(item, dict) else (repr(item),)


class SchemaValidator:
    """Walks a value and its schema node by node, collecting causes (CEL rules by node id)."""

    def __init__(self, rules: dict[int, list[CelRule]]) -> None:
        self.rules = rules

    def check(
        self, value: Any, schema: dict[str, Any], path: str, old: Any, causes: list[Cause]
    ) -> None:
        """Add to `causes` what is wrong with `value` (`old`: the value before an update)."""
        self._validate(value, schema, path, old, causes)

    def _validate(
        self, value: Any, schema: dict[str, Any], path: str, old: Any, causes: list[Cause]
    ) -> None:
        if old is not None and value == old:
            return  # ratcheting (Kubernetes 1.30+): what an update leaves unchanged stays valid
        where = path or "<root>"
        if value is None:
            if not schema.get("nullable"):
                causes.append(Cause(path, "FieldValueRequired", "Required value"))
            return
        type_ = schema.get("type")
        if schema.get("x-kubernetes-int-or-string"):
            if isinstance(value, bool) or not isinstance(value, int | str):
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {quote(value)}: {where} in body must be of type integer-or-string",
                    )
                )
                return
        elif type_ and not _type_ok(value, type_):
            actual = next((t for t in _TYPES if _type_ok(value, t)), "null")
            causes.append(
                Cause(
                    path,
                    "FieldValueTypeInvalid",
                    f'Invalid value: "{actual}": {where} in body must be of type {type_}: "{actual}"',
                )
            )
            return
        before = len(causes)
        self._values(value, schema, path, causes)
        own_ok = len(causes) == before  # CEL rules run on values of the right shape only
        if isinstance(value, dict):
            self._object(value, schema, path, old if isinstance(old, dict) else None, causes)
        elif isinstance(value, list):
            self._array(value, schema, path, old if isinstance(old, list) else None, causes)
        for key in ("allOf", "anyOf", "oneOf"):
            if key in schema:
                results = []
                for branch in schema[key]:
                    found: list[Cause] = []
                    self._values(value, branch, path, found)
                    results.append(not found)
                ok = {"allOf": all, "anyOf": any, "oneOf": lambda r: sum(r) == 1}[key](results)
                if not ok:
                    causes.append(
                        Cause(
                            path,
                            "FieldValueInvalid",
                            f"Invalid value: {quote(value)}: {where} in body must validate {key}",
                        )
                    )
        if own_ok and id(schema) in self.rules:
            self._cel(value, schema, path, old, causes)

    def _values(self, value: Any, schema: dict[str, Any], path: str, causes: list[Cause]) -> None:
        """The value validations (no recursion): enum, bounds, lengths, pattern, format."""
        where = path or "<root>"
        if isinstance(value, bool):
            pass
        elif isinstance(value, int | float):
            if "type" in schema and not _type_ok(value, schema["type"]):
                causes.append(
                    Cause(
                        path,
                        "FieldValueTypeInvalid",
                        f"Invalid value: {quote(value)}: {where} in body must be of type {schema['type']}",
                    )
                )
            for key, cmp, word in (
                ("minimum", lambda a, b: a < b, "greater than or equal to"),
                ("maximum", lambda a, b: a > b, "less than or equal to"),
            ):
                if key in schema:
                    exclusive = schema.get(f"exclusive{key.capitalize()}", False)
                    bound = schema[key]
                    if cmp(value, bound) or (exclusive and value == bound):
                        word = word.replace(" or equal to", "") if exclusive else word
                        causes.append(
                            Cause(
                                path,
                                "FieldValueInvalid",
                                f"Invalid value: {quote(value)}: {where} in body should be {word} {bound}",
                            )
                        )
            if "multipleOf" in schema and value % schema["multipleOf"]:
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {quote(value)}: {where} in body should be a multiple of {schema['multipleOf']}",
                    )
                )
        elif isinstance(value, str):
            if "type" in schema and schema["type"] != "string":
                causes.append(
                    Cause(
                        path,
                        "FieldValueTypeInvalid",
                        f"Invalid value: {quote(value)}: {where} in body must be of type {schema['type']}",
                    )
                )
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                causes.append(
                    Cause(
                        path,
                        "FieldValueTooLong",
                        f"Too long: may not be longer than {schema['maxLength']}",
                    )
                )
            if "minLength" in schema and len(value) < schema["minLength"]:
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {quote(value)}: {where} in body should be at least {schema['minLength']} chars long",
                    )
                )
            if "pattern" in schema and not re.search(schema["pattern"], value):
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {quote(value)}: {where} in body should match '{schema['pattern']}'",
                    )
                )
            if "format" in schema and not _format_ok(value, schema["format"]):
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {quote(value)}: {where} in body must be of type {schema['format']}: {quote(value)}",
                    )
                )
        elif isinstance(value, dict) and "type" in schema and schema["type"] != "object":
            causes.append(
                Cause(
                    path,
                    "FieldValueTypeInvalid",
                    f'Invalid value: "object": {where} in body must be of type {schema["type"]}',
                )
            )
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(quote(str(v)) for v in schema["enum"])
            causes.append(
                Cause(
                    path,
                    "FieldValueNotSupported",
                    f"Unsupported value: {quote(value)}: supported values: {allowed}",
                )
            )

    def _object(
        self,
        value: dict[str, Any],
        schema: dict[str, Any],
        path: str,
        old: dict[str, Any] | None,
        causes: list[Cause],
    ) -> None:
        for key in schema.get("required", []):
            if key not in value:
                causes.append(Cause(_join(path, key), "FieldValueRequired", "Required value"))
        for bound, cmp, word in (
            ("maxProperties", int.__gt__, "at most"),
            ("minProperties", int.__lt__, "at least"),
        ):
            if bound in schema and cmp(len(value), schema[bound]):
                causes.append(
                    Cause(
                        path,
                        "FieldValueInvalid",
                        f"Invalid value: {len(value)}: {path} in body should have {word} {schema[bound]} properties",
                    )
                )
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None and not (path == "" and key == "metadata"):
                sub_path = _join(path, key) if key in props else f"{path}[{key}]"
                self._validate(item, sub, sub_path, (old or {}).get(key), causes)

    def _array(
        self,
        value: list[Any],
        schema: dict[str, Any],
        path: str,
        old: list[Any] | None,
        causes: list[Cause],
    ) -> None:
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append(
                Cause(
                    path,
                    "FieldValueTooMany",
                    f"Too many: {len(value)}: must have at most {schema['maxItems']} items",
                )
            )
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(
                Cause(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {len(value)}: {path} in body should have at least {schema['minItems']} items",
                )
            )
        list_type = schema.get("x-kubernetes-list-type", "atomic")
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen: set[tuple[Any, ...]] = set()
        old_by_key = {}
        if list_type == "map":
            old_by_key = {_list_key(o, keys): o for o in old or [] if isinstance(o, dict)}
        for i, item in enumerate(value):
            if list_type in ("set", "map") or schema.get("uniqueItems"):
                key = _list_key(item, keys) if list_type == "map" else (repr(item),)
                shown = {k: item.get(k) for k in keys} if list_type == "map" else item
                if key in seen:
                    causes.append(
                        Cause(
                            f"{path}[{i}]",
                            "FieldValueDuplicate",
                            f"Duplicate value: {json.dumps(shown)}",
                        )
                    )
                seen.add(key)
            if "items" in schema:
                # Only map-list items correlate with the old list (for transition rules).
                old_item = old_by_key.get(_list_key(item, keys)) if list_type == "map" else None
                self._validate(item, schema["items"], f"{path}[{i}]", old_item, causes)

    def _cel(
        self, value: Any, schema: dict[str, Any], path: str, old: Any, causes: list[Cause]
    ) -> None:
        typed = cel_typed(value, schema)
        old_typed = None if old is None else cel_typed(old, schema)
        for rule in self.rules[id(schema)]:
            if rule.transition and old_typed is None:
                continue  # transition rules run only when there is an old value to compare
            message = rule.check(typed, old_typed)
            if message is not None:
                field = path + rule.field_path if rule.field_path else path
                shown = '"object"' if isinstance(value, dict) else quote(value)
                causes.append(Cause(field, rule.reason, f"Invalid value: {shown}: {message}"))


def cel_typed(value: Any, schema: dict[str, Any]) -> Any:
    """`value` as CEL sees it: `type: number` values are doubles even when written as 4."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {
            k: cel_typed(v, props.get(k, extra if isinstance(extra, dict) else {}))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [cel_typed(v, schema.get("items", {})) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value

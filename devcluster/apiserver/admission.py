"""What the API server does to an object between decoding a write and storing it.

Custom resources (from the CRD files): unknown fields pruned (a `Warning` header names them;
`fieldValidation=Strict` refuses them with 400, as for kubectl), defaults filled, then the
structural schema and its CEL rules validated (422 Invalid with one cause per violation).

Built-in kinds, at the Kubernetes version the chart claims as its minimum: quantities decoded
and stored canonically (a malformed one is a 400, as in the server's decoder), then the
kubernetes-validate JSON schema of that version in strict form (an unknown field is a 400
"strict decoding error"; `fieldValidation=Ignore|Warn` drops it instead) and the rules of
core_rules.py (422). Unlike a real server, which defaults to Warn for clients that do not
ask, unknown built-in fields are refused unless the client asks otherwise: a field the oldest
supported server would silently drop is a bug the tests should see.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvfleet.devcluster.apiserver.api_status import ApiError, Cause, invalid, quote
from kvfleet.devcluster.apiserver.builtin_schemas import Shape, kind_definition, validator
from kvfleet.devcluster.apiserver.canonical_quantity import QuantityError, canonical_quantity
from kvfleet.devcluster.apiserver.core_rules import check_builtin
from kvfleet.devcluster.apiserver.crd_schema import CrdSchema
from kvfleet.devcluster.apiserver.object_meta_rules import check_metadata


@dataclass(slots=True)
class WriteOptions:
    """A write request's options, and the warnings its answer will carry."""

    manager: str
    field_validation: str | None = None  # Strict, Warn, Ignore, or None (not asked)
    force: bool = False
    dry_run: bool = False
    warnings: list[str] = field(default_factory=list)


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class Admission:
    """Validation, defaulting and normalisation for every kind the emulator serves."""

    def __init__(self, schema_version: str, crd_paths: list[pathlib.Path]) -> None:
        self.schema_version = schema_version
        self.enabled = True
        self.crds: dict[tuple[str, str], CrdSchema] = {}  # (apiVersion, kind) -> schema
        for path in crd_paths:
            crd = CrdSchema.load(path)
            self.crds[(f"{crd.group}/{crd.version['name']}", crd.kind)] = crd

    def shape(self, obj: dict[str, Any]) -> Shape:
        """The schema view server-side apply uses for this object's kind."""
        crd = self.crds.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        if crd is not None:
            return Shape.custom(crd.schema, self.schema_version)
        name = self._definition(obj)
        return Shape.builtin(self.schema_version, name)

    def _definition(self, obj: dict[str, Any]) -> str:
        name = kind_definition(self.schema_version, obj.get("apiVersion", ""), obj.get("kind", ""))
        if name is None:
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource "
                f"({obj.get('kind')} {obj.get('apiVersion')} is not served by Kubernetes "
                f"{self.schema_version})",
            )
        return name

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Let writes through unchecked (objects stored before today's schema existed)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def admit(self, obj: dict[str, Any], old: dict[str, Any] | None, opts: WriteOptions) -> None:
        """Prune, default, normalise and validate `obj` in place; ApiError when refused."""
        if not self.enabled:
            return
        crd = self.crds.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        if crd is not None:
            self._admit_custom(crd, obj, old, opts)
        else:
            self._admit_builtin(obj, old, opts)

    def prepare_applied(self, applied: dict[str, Any], opts: WriteOptions) -> dict[str, Any]:
        """An apply configuration made comparable with stored objects (a custom resource's
        unknown fields pruned, a built-in's quantities canonical), as the server decodes it."""
        applied = copy.deepcopy(applied)
        crd = self.crds.get((applied["apiVersion"], applied["kind"]))
        if crd is not None:
            self._unknown_fields(crd.prune(applied), opts, refuse_by_default=False)
        else:
            _decode_quantities(
                applied, Shape.builtin(self.schema_version, self._definition(applied))
            )
        return applied

    def _admit_custom(
        self, crd: CrdSchema, obj: dict[str, Any], old: dict[str, Any] | None, opts: WriteOptions
    ) -> None:
        unknown = crd.prune(obj)
        self._unknown_fields(unknown, opts, refuse_by_default=False)
        crd.default(obj)
        causes = check_metadata(obj) + crd.validate(obj, old)
        if causes:
            raise invalid(crd.kind, crd.group, obj["metadata"].get("name", ""), causes)

    def _unknown_fields(
        self, unknown: list[str], opts: WriteOptions, refuse_by_default: bool
    ) -> None:
        if not unknown:
            return
        mode = opts.field_validation or ("Strict" if refuse_by_default else "Warn")
        texts = [f'unknown field "{u}"' for u in unknown]
        if mode == "Strict":
            raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(texts))
        if mode == "Warn":
            opts.warnings += texts

    def _admit_builtin(
        self, obj: dict[str, Any], old: dict[str, Any] | None, opts: WriteOptions
    ) -> None:
        definition = self._definition(obj)
        _decode_quantities(obj, Shape.builtin(self.schema_version, definition))
        errors = list(validator(self.schema_version, definition).iter_errors(obj))
        unknown = [
            _path([*e.absolute_path, name])
            for e in errors
            if e.validator == "additionalProperties"
            for name in sorted(set(e.instance) - set(e.schema.get("properties", {})))
        ]
        self._unknown_fields(unknown, opts, refuse_by_default=True)
        if unknown:  # asked to drop them: drop, and validate what is left
            for e in errors:
                if e.validator == "additionalProperties":
                    for name in set(e.instance) - set(e.schema.get("properties", {})):
                        del e.instance[name]
            errors = list(validator(self.schema_version, definition).iter_errors(obj))
        causes = [_schema_cause(e) for e in errors] + check_builtin(obj, old)
        if causes:
            group = obj["apiVersion"].rpartition("/")[0]
            raise invalid(obj["kind"], group, obj["metadata"].get("name", ""), causes)


def _decode_quantities(obj: dict[str, Any], shape: Shape) -> None:
    try:
        normalise_quantities(obj, shape)
    except QuantityError as exc:
        kind, version = obj["kind"], obj["apiVersion"].rpartition("/")[2]
        raise ApiError(
            400,
            "BadRequest",
            f'{kind} in version "{version}" cannot be handled '
            f"as a {kind}: {exc} (got {quote(exc.text)})",
        ) from exc


def _schema_cause(error: Any) -> Cause:
    path = _path(error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1]
        return Cause(_path([*error.absolute_path, missing]), "FieldValueRequired", "Required value")
    if error.validator == "enum":
        allowed = ", ".join(quote(str(v)) for v in error.validator_value)
        return Cause(
            path,
            "FieldValueNotSupported",
            f"Unsupported value: {quote(error.instance)}: supported values: {allowed}",
        )
    return Cause(
        path, "FieldValueInvalid", f"Invalid value: {quote(error.instance)}: {error.message}"
    )


def normalise_quantities(value: Any, shape: Shape) -> Any:
    """Rewrite every Quantity-typed field in place as the server stores it; QuantityError if one
    does not parse."""
    if isinstance(value, dict):
        for k, v in value.items():
            sub = shape.field(k)
            if sub.is_quantity and v is not None:
                value[k] = canonical_quantity(v)
            else:
                normalise_quantities(v, sub)
    elif isinstance(value, list):
        item = shape.item()
        for i, v in enumerate(value):
            if item.is_quantity and v is not None:
                value[i] = canonical_quantity(v)
            else:
                normalise_quantities(v, item)
    return value

"""The request fields that constrain the output, read into one `StructuredOutputsParams`:
OpenAI's `response_format` (json_object, json_schema) and vLLM's `structured_outputs` and older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. The constraint is
converted here, so a schema, regex or grammar the engine cannot enforce is a 400 naming the
request's own field, before anything is queued."""

from __future__ import annotations

import json
from typing import Any

from kvfleet.runtime.engine.structured_outputs import (
    StructuredOutputError,
    StructuredOutputsParams,
    grammar_of,
)
from kvfleet.runtime.server.api_error import APIError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs' keys, as vLLM names them, and what each becomes.
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The body's output constraint, validated and converted, or None when it asks for none."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            found.append((name, {name.removeprefix("guided_"): body[name]}))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured(so)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _bad(found[1][0], f"give one output constraint, got several ({names})")
    param, spec = found[0]
    kind = next(iter(spec))
    if param == "structured_outputs":
        param = f"structured_outputs.{kind}"
    params = _params(param, kind, spec[kind])
    try:
        grammar_of(params)
    except StructuredOutputError as exc:
        raise _bad(param, exc.message) from None
    return params


def _response_format(value: Any) -> tuple[str, dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format", 'must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind != "json_schema":
        raise APIError(
            400,
            f"response_format.type: {kind[:40]!r} is not supported; use text, json_object or "
            f"json_schema",
            param="response_format.type",
            code="unsupported_parameter",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema.name", "is required (a non-empty string)")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("response_format.json_schema.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _bad("response_format.json_schema.description", "must be a string")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: without a schema the model may answer any JSON object
        return "response_format.json_schema", {"json_object": True}
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
    return "response_format.json_schema.schema", {"json": schema}


def _structured(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad("structured_outputs", "must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    for key in given:
        if key not in _STRUCTURED_KEYS and key != "disable_any_whitespace":
            raise APIError(
                400,
                f"structured_outputs.{key[:40]}: is not supported; use one of "
                f"{', '.join(_STRUCTURED_KEYS)}",
                param=f"structured_outputs.{key[:40]}",
                code="unsupported_parameter",
            )
    kinds = [k for k in given if k in _STRUCTURED_KEYS]
    if len(kinds) != 1:
        raise _bad(
            "structured_outputs",
            f"give exactly one of {', '.join(_STRUCTURED_KEYS)}; got {', '.join(kinds) or 'none'}",
        )
    return {kinds[0]: given[kinds[0]]}


def _params(param: str, kind: str, value: Any) -> StructuredOutputsParams:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _bad(param, f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _bad(param, "must be a JSON schema object")
        return StructuredOutputsParams(json=value)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(param, "must be a non-empty string")
        return StructuredOutputsParams(**{kind: value})
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _bad(param, "must be an array of strings")
        try:
            return StructuredOutputsParams(choice=tuple(value))
        except StructuredOutputError as exc:
            raise _bad(param, exc.message) from None
    if value is not True:
        raise _bad(param, "must be true")
    return StructuredOutputsParams(json_object=True)

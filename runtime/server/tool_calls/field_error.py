"""The 400 a bad tool field gets: its path first, then what it must be."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.server.api_error import APIError


def field_error(param: str, problem: str) -> APIError:
    """An invalid_request_error whose message and `param` name the field's path."""
    return APIError(400, f"{param}: {problem}", param=param)


def json_type(value: Any) -> str:
    """The JSON name of value's type, for "got ..." in messages."""
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else type(value).__name__)

"""A tool call read out of a model's output, in OpenAI's form: a name and its arguments as a
JSON string."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    """One call: `arguments` is a JSON string holding an object, as OpenAI returns it."""

    name: str
    arguments: str


@dataclass(slots=True)
class ExtractedToolCalls:
    """A finished message split into its text (None when there is none) and its calls."""

    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


def arguments_json(arguments: dict[str, Any]) -> str:
    """The one serialisation of arguments, so that streamed and whole answers agree."""
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments",), *, keyless: bool = False
) -> ParsedToolCall | None:
    """`{"name": ..., <argument key>: {...}}` as a call, or None when it is not one.

    Arguments may come as a string holding a JSON object (some models quote them). Without an
    argument key the object is a call only if `keyless`: a JSON answer such as
    `{"name": "Ada", "age": 36}` must stay text."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None and not keyless:
        return None
    arguments = obj[key] if key is not None else {}
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        return ParsedToolCall(name=name.strip(), arguments=arguments_json(arguments))
    except (ValueError, RecursionError):  # RecursionError: nested past what json can read
        return None

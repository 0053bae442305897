"""A forced call (tool_choice "required" or a named function): the JSON schema the output is
constrained to, and the calls read back out of the constrained output."""

from __future__ import annotations

import copy
import json
from typing import Any

from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall, arguments_json
from kvfleet.runtime.server.tool_calls.request import ToolsRequest
from kvfleet.runtime.server.tool_calls.schema_embedding import embed_schema


def required_schema(req: ToolsRequest) -> dict[str, Any]:
    """An array of one or more `{"name": <a tool's>, "parameters": <its arguments>}`; of
    exactly one when parallel calls are off."""
    if not req.tools:
        raise ValueError("a forced call needs tools")
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(req.tools):
        at = f"/items/anyOf/{i}/properties/parameters"
        parameters = embed_schema(tool.parameters, at, f"{tool.name}.", defs)
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": tool.name},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not req.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(req: ToolsRequest) -> dict[str, Any]:
    """The named function's parameters schema: the output is its arguments object."""
    if req.choice != "named" or req.named is None:
        raise ValueError(f"tool_choice is {req.choice!r}, not a named function")
    return copy.deepcopy(req.tool(req.named).parameters)


def calls_from_forced_output(req: ToolsRequest, text: str) -> list[ParsedToolCall]:
    """The calls in output constrained by required_schema or named_schema; ValueError when it
    is not such output (cut short by max_tokens, most often)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("the output nests too deeply") from None
    if req.choice == "named" and req.named is not None:
        if not isinstance(value, dict):
            raise ValueError("the output is not a JSON object of arguments")
        return [ParsedToolCall(name=req.named, arguments=arguments_json(value))]
    if req.choice != "required":
        raise ValueError(f"tool_choice {req.choice!r} forces no call")
    if not isinstance(value, list) or not value:
        raise ValueError("the output is not a non-empty JSON array of calls")
    if not req.parallel and len(value) > 1:
        raise ValueError(f"the output holds {len(value)} calls, and parallel calls are off")
    names = {tool.name for tool in req.tools}
    calls = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("a call in the output is not a JSON object")
        name, parameters = item.get("name"), item.get("parameters")
        if name not in names or not isinstance(parameters, dict):
            raise ValueError(f"the output's call {item!r:.80} names no tool or lacks parameters")
        calls.append(ParsedToolCall(name=name, arguments=arguments_json(parameters)))
    return calls

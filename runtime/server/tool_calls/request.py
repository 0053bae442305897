"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated into what the
server needs: each bad value an `APIError` naming the field and the rule it breaks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.engine.schema_check import schema_problem
from kvfleet.runtime.server.tool_calls.field_error import field_error, json_type

MAX_TOOLS = 128  # OpenAI's limit
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_MAX_REASON = 200  # characters of a schema error's reason: enough to fix it, short to read
CHOICES = ("none", "auto", "required")
_CHOICE_SHAPE = (
    '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
)


@dataclass(slots=True, frozen=True)
class Tool:
    """One function the model may call; `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(slots=True, frozen=True)
class ToolsRequest:
    """The tools offered and how the model may use them (choice "named": call `named`)."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as OpenAI writes them, for the chat template's `tools`."""
        out = []
        for tool in self.tools:
            function: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                function["description"] = tool.description
            function["parameters"] = tool.parameters
            out.append({"type": "function", "function": function})
        return out

    def tool(self, name: str) -> Tool:
        """The tool called name (KeyError if none is)."""
        for tool in self.tools:
            if tool.name == name:
                return tool
        raise KeyError(name)


def parse_tools(body: dict[str, Any]) -> ToolsRequest | None:
    """The request's tool fields, or None when it offers no tools and asks for no call."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise field_error("parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}")
    choice, named = _choice(body.get("tool_choice"), tools)
    if not tools and choice in ("none", "auto"):
        return None
    return ToolsRequest(tools=tools, choice=choice, named=named, parallel=parallel)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise field_error("tools", f"must be an array, got {json_type(value)}")
    if len(value) > MAX_TOOLS:
        raise field_error("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    tools: list[Tool] = []
    first: dict[str, int] = {}
    for i, item in enumerate(value):
        tool = _tool(item, f"tools[{i}]")
        if tool.name in first:
            raise field_error(
                f"tools[{i}].function.name",
                f"{tool.name!r} is already the name of tools[{first[tool.name]}]",
            )
        first[tool.name] = i
        tools.append(tool)
    return tuple(tools)


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict):
        raise field_error(where, f"must be an object, got {json_type(item)}")
    kind = item.get("type")
    if kind != "function":
        raise field_error(f"{where}.type", f"must be 'function', got {kind!r}")
    function = item.get("function")
    if not isinstance(function, dict):
        raise field_error(f"{where}.function", f"must be an object, got {json_type(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise field_error(f"{where}.function.name", f"must be a string, got {json_type(name)}")
    if not NAME_PATTERN.fullmatch(name):
        raise field_error(
            f"{where}.function.name",
            f"must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise field_error(
            f"{where}.function.description", f"must be a string, got {json_type(description)}"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise field_error(f"{where}.function.strict", f"must be a boolean, got {json_type(strict)}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    _check_schema(parameters, f"{where}.function.parameters")
    return Tool(name=name, description=description, parameters=parameters)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise field_error(where, f"must be an object (a JSON schema), got {json_type(schema)}")
    problem = schema_problem(schema)
    if problem is not None:
        reason = f"at {problem.pointer}: {problem.message}"
        raise field_error(where, f"not a valid JSON schema: {_shorten(reason)}")


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise field_error("tool_choice", f"must be {_CHOICE_SHAPE}, got {value!r}")
        if value == "required" and not tools:
            raise field_error("tool_choice", "'required' needs tools, and none were given")
        return value, None
    if not isinstance(value, dict):
        raise field_error("tool_choice", f"must be {_CHOICE_SHAPE}, got {json_type(value)}")
    if value.get("type") != "function":
        raise field_error("tool_choice.type", f"must be 'function', got {value.get('type')!r}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise field_error("tool_choice.function", f"must be an object, got {json_type(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise field_error("tool_choice.function.name", f"must be a string, got {json_type(name)}")
    if not tools:
        raise field_error("tool_choice", f"names function {name!r}, and no tools were given")
    if name not in {t.name for t in tools}:
        have = ", ".join(t.name for t in tools)
        raise field_error(
            "tool_choice.function.name", f"no tool named {name!r} in tools (have: {have})"
        )
    return "named", name


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."

"""A chat request's tool fields: what the server reads from a valid one, and the 400 (naming
the field) that each invalid one gets."""

from __future__ import annotations

from typing import Any

import pytest
from kvfleet.runtime.server.api_error import APIError
from kvfleet.runtime.server.tool_calls.request import MAX_TOOLS, Tool, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def refused(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_tools(body)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    assert info.value.message.startswith(f"{info.value.param}: ")
    return info.value


def test_tools_offered_default_to_auto_and_parallel_calls():
    req = parse_tools({"tools": [WEATHER, TIME]})
    assert req is not None
    assert (req.choice, req.named, req.parallel) == ("auto", None, True)
    assert req.tools[0] == Tool(
        "get_weather", "Current weather in a city", WEATHER["function"]["parameters"]
    )
    # A function without parameters takes none: an empty object.
    assert req.tools[1] == Tool("get_time", None, {"type": "object", "properties": {}})


def test_the_template_sees_the_tools_as_openai_writes_them():
    req = parse_tools({"tools": [WEATHER, TIME]})
    assert req is not None
    assert req.template_tools() == [
        WEATHER,
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tools": None},
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": [], "tool_choice": "none"},
        {"tools": [], "tool_choice": "auto"},
        {"parallel_tool_calls": False},
    ],
)
def test_a_request_that_offers_no_tools_asks_for_nothing(body: dict[str, Any]):
    assert parse_tools(body) is None


def test_tool_choice_none_still_shows_the_tools_to_the_template():
    req = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert req is not None and req.choice == "none"
    assert req.template_tools() == [WEATHER]


def test_a_named_function_and_parallel_calls_off():
    req = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
        }
    )
    assert req is not None
    assert (req.choice, req.named, req.parallel) == ("named", "get_time", False)


def test_required_choice():
    req = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert req is not None and req.choice == "required"


def test_openais_limit_of_128_tools():
    tools = [tool(f"f{i}") for i in range(MAX_TOOLS)]
    req = parse_tools({"tools": tools})
    assert req is not None and len(req.tools) == MAX_TOOLS
    error = refused({"tools": [*tools, tool("one_more")]})
    assert error.param == "tools"
    assert "at most 128 tools, got 129" in error.message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": {"get_weather": WEATHER}}, "tools", "must be an array, got object"),
        ({"tools": [WEATHER, "get_time"]}, "tools[1]", "must be an object, got string"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "must be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object, got null"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "string"),
        ({"tools": [tool("get weather")]}, "tools[0].function.name", "got 'get weather'"),
        ({"tools": [tool("x" * 65)]}, "tools[0].function.name", "1 to 64 letters"),
        ({"tools": [tool("f", description=3)]}, "tools[0].function.description", "string"),
        ({"tools": [tool("f", strict="yes")]}, "tools[0].function.strict", "boolean"),
        (
            {"tools": [WEATHER, TIME, WEATHER]},
            "tools[2].function.name",
            "'get_weather' is already the name of tools[0]",
        ),
        (
            {"tools": [tool("f", parameters=[{"type": "string"}])]},
            "tools[0].function.parameters",
            "must be an object (a JSON schema), got array",
        ),
        (
            {
                "tools": [
                    tool("f", parameters={"type": "object", "properties": {"a": {"type": "text"}}})
                ]
            },
            "tools[0].function.parameters",
            "not a valid JSON schema: at #/properties/a/type:",
        ),
        (
            {"tools": [tool("f", parameters={"type": "object", "required": "city"})]},
            "tools[0].function.parameters",
            '"city" is not of type "array"',
        ),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "got 'any'"),
        ({"tools": [WEATHER], "tool_choice": True}, "tool_choice", "got boolean"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "function": {"name": "f"}}},
            "tool_choice.type",
            "must be 'function'",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
            "tool_choice.function",
            "must be an object, got null",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 1}}},
            "tool_choice.function.name",
            "must be a string, got integer",
        ),
        (
            {
                "tools": [WEATHER, TIME],
                "tool_choice": {"type": "function", "function": {"name": "get_news"}},
            },
            "tool_choice.function.name",
            "no tool named 'get_news' in tools (have: get_weather, get_time)",
        ),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
            "no tools were given",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "false"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_each_invalid_field_is_named_in_a_400(body: dict[str, Any], param: str, says: str):
    error = refused(body)
    assert error.param == param
    assert says in error.message


def test_a_schema_error_is_short_enough_to_read():
    huge = {"type": "object", "enum": "x" * 5000}  # enum must be an array: says so, quoting it
    error = refused({"tools": [tool("f", parameters=huge)]})
    assert error.message.startswith("tools[0].function.parameters: not a valid JSON schema: ")
    assert len(error.message) < 300


def test_a_draft_07_schema_is_checked_by_its_own_draft():
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "definitions": {"city": {"type": "string"}},
        "properties": {"city": {"$ref": "#/definitions/city"}},
    }
    req = parse_tools({"tools": [tool("f", parameters=draft7)]})
    assert req is not None and req.tools[0].parameters == draft7
    bad = {**draft7, "exclusiveMinimum": True}  # draft-04 syntax: draft-07 wants a number
    assert refused({"tools": [tool("f", parameters=bad)]}).param == "tools[0].function.parameters"

"""A forced call: the schema a grammar engine constrains the output to accepts exactly the
calls the request allows, and the calls are read back out of such output."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator, ValidationError
from kvfleet.runtime.server.tool_calls.forced import (
    calls_from_forced_output,
    named_schema,
    required_schema,
)
from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall
from kvfleet.runtime.server.tool_calls.request import ToolsRequest, parse_tools

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}


def request(*tools: tuple[str, dict[str, Any]], choice: Any = "required", parallel=True):
    req = parse_tools(
        {
            "tools": [
                {"type": "function", "function": {"name": n, "parameters": p}} for n, p in tools
            ],
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }
    )
    assert isinstance(req, ToolsRequest)
    return req


def accepts(schema: dict[str, Any], instance: Any) -> bool:
    Draft202012Validator.check_schema(schema)
    try:
        Draft202012Validator(schema).validate(instance)
    except ValidationError:
        return False
    return True


TWO = (("get_weather", WEATHER_PARAMS), ("get_time", {"type": "object", "properties": {}}))
PARIS = {"name": "get_weather", "parameters": {"city": "Paris"}}
NOW = {"name": "get_time", "parameters": {}}


@pytest.mark.parametrize(
    ("instance", "ok"),
    [
        ([PARIS], True),
        ([PARIS, NOW], True),
        ([], False),  # "required": at least one call
        ([{"name": "get_news", "parameters": {}}], False),
        ([{"name": "get_weather", "parameters": {}}], False),  # city is required
        ([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "K"}}], False),
        ([{"name": "get_weather"}], False),
        ([{**PARIS, "id": "x"}], False),
        (PARIS, False),
    ],
)
def test_required_schema_accepts_only_calls_of_the_tools(instance: Any, ok: bool):
    assert accepts(required_schema(request(*TWO)), instance) is ok


def test_parallel_calls_off_allows_exactly_one_call():
    schema = required_schema(request(*TWO, parallel=False))
    assert accepts(schema, [PARIS])
    assert not accepts(schema, [PARIS, NOW])


def test_each_tools_defs_resolve_from_the_root_under_its_own_name():
    # Both tools define "Place", differently: each call must keep its own.
    by_city = {
        "type": "object",
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            }
        },
        "properties": {"where": {"$ref": "#/$defs/Place"}},
        "required": ["where"],
    }
    by_coordinates = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "definitions": {
            "Place": {
                "type": "object",
                "properties": {"lat": {"$ref": "#/definitions/Degrees"}},
                "required": ["lat"],
            },
            "Degrees": {"type": "number", "minimum": -90, "maximum": 90},
        },
        "properties": {"where": {"$ref": "#/definitions/Place"}},
        "required": ["where"],
    }
    schema = required_schema(request(("forecast", by_city), ("tide", by_coordinates)))
    assert accepts(schema, [{"name": "forecast", "parameters": {"where": {"city": "Brest"}}}])
    assert accepts(schema, [{"name": "tide", "parameters": {"where": {"lat": 48.4}}}])
    assert not accepts(schema, [{"name": "forecast", "parameters": {"where": {"lat": 48.4}}}])
    assert not accepts(schema, [{"name": "tide", "parameters": {"where": {"city": "Brest"}}}])
    assert not accepts(schema, [{"name": "tide", "parameters": {"where": {"lat": 123}}}])
    assert len(schema["$defs"]) == 3


def test_a_recursive_schema_still_refers_to_itself():
    tree = {
        "type": "object",
        "properties": {
            "label": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["label"],
        "additionalProperties": False,
    }
    schema = required_schema(request(("plant", tree), *TWO))
    good = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
    assert accepts(schema, [{"name": "plant", "parameters": good}])
    bad = {"label": "a", "children": [{"label": "b", "children": [{"name": "c"}]}]}
    assert not accepts(schema, [{"name": "plant", "parameters": bad}])


def test_a_named_function_constrains_the_output_to_its_arguments():
    req = request(*TWO, choice={"type": "function", "function": {"name": "get_weather"}})
    schema = named_schema(req)
    assert schema == WEATHER_PARAMS
    assert accepts(schema, {"city": "Paris"})
    assert not accepts(schema, {"town": "Paris"})


def test_named_schema_refuses_a_request_without_a_named_function():
    with pytest.raises(ValueError):
        named_schema(request(*TWO))


def test_calls_read_back_from_the_required_array_keep_unicode():
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    calls = calls_from_forced_output(request(*TWO), output)
    assert calls == [
        ParsedToolCall("get_weather", '{"city": "Zürich"}'),
        ParsedToolCall("get_time", "{}"),
    ]


def test_a_named_functions_output_is_its_arguments():
    req = request(*TWO, choice={"type": "function", "function": {"name": "get_weather"}})
    calls = calls_from_forced_output(req, '{"city":"東京","unit":"C"}')
    assert calls == [ParsedToolCall("get_weather", '{"city": "東京", "unit": "C"}')]
    assert json.loads(calls[0].arguments) == {"city": "東京", "unit": "C"}


@pytest.mark.parametrize(
    "output",
    [
        '[{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
        "",
        "[]",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '[{"name": "get_news", "parameters": {}}]',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ],
)
def test_output_that_is_not_a_forced_call_raises(output: str):
    with pytest.raises(ValueError):
        calls_from_forced_output(request(*TWO), output)


def test_two_calls_when_parallel_calls_are_off_raise():
    output = json.dumps([PARIS, NOW])
    with pytest.raises(ValueError):
        calls_from_forced_output(request(*TWO, parallel=False), output)


def test_a_named_functions_cut_output_raises():
    req = request(*TWO, choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(ValueError):
        calls_from_forced_output(req, '{"city": "Pa')

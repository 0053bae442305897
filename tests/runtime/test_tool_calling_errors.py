"""Tool-calling input the server cannot serve is a 400 in OpenAI's shape naming the field:
a tool whose parameters are not a JSON schema, a tool_choice naming an absent function, a
forced call combined with response_format, a malformed tool turn in the history."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_fixtures import assert_error, request

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str = "get_weather", parameters=WEATHER) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def chat(model: str, messages=None, **fields) -> dict:
    messages = messages or [{"role": "user", "content": "Weather in Paris?"}]
    return {"model": model, "messages": messages, "max_tokens": 8, **fields}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
BAD = [
    ({"tools": [tool(parameters={"type": "nonsense"})], "tool_choice": "required"},
     "tools[0].function.parameters", ["nonsense"]),
    ({"tools": [tool(parameters=[1])], "tool_choice": "required"},
     "tools[0].function.parameters", []),
    ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", ["nope", "get_weather"]),
    ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", []),
    ({"tool_choice": "required"}, "tool_choice", []),
    ({"tools": [tool(), tool()], "tool_choice": "required"}, "tools[1].function.name", []),
    ({"tools": [tool()], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", ["response_format"]),
    ({"tools": [tool(parameters={"type": "object", "not": {"required": ["city"]}})],
      "tool_choice": "required"}, "tools", ["'not'"]),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "18C"}]},
     "messages[1].tool_call_id", []),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments", []),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_bad_tool_input_is_a_400_naming_the_field(tiny_server, model, fields, param, words):
    r = request(tiny_server.port, "POST", CHAT, chat(model, **fields))
    assert_error(r, 400, param, *words)


def test_a_history_with_calls_and_results_is_served(tiny_server, model):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    r = request(tiny_server.port, "POST", CHAT, chat(model, messages, tools=[tool()],
                                                     tool_choice="none"))  # fmt: skip
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"].get("tool_calls") is None


def test_a_named_call_is_served_without_a_parser(tiny_server, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = request(tiny_server.port, "POST", CHAT,
                chat(model, tools=[tool()], tool_choice=choice, max_tokens=60))  # fmt: skip
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":  # a random model may run out of tokens first
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert call["id"].startswith("call_") and call["type"] == "function"
    else:
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].startswith("{")

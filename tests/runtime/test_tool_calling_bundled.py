"""Tool calling end to end with the official openai client against `kvfleet serve` of the
bundled model, given a Hermes-style chat template that shows tools (`--chat-template`) and
`--enable-auto-tool-choice --tool-call-parser hermes`: a two-turn weather exchange, required,
named and parallel calls, the same streamed; arguments always valid against the tool's schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from server_fixtures import ServerProcess, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).with_name("hermes_tool_template.jinja")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris and in London?"}]


@pytest.fixture(scope="module")
def server(bundled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        "bundled",
        tmp_path_factory.mktemp("serve-tools"),
        *("--num-threads", "2", "--max-model-len", "2048", "--kv-cache-memory", "256MiB"),
        *("--chat-template", str(TEMPLATE)),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def ask(client, messages=QUESTION, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kwargs)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs) -> tuple[list[dict], str | None, str]:
    """The calls a stream carries, put together as a client does, its finish_reason and text."""
    calls: dict[int, dict] = {}
    finish, text = None, ""
    for chunk in ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            assert len(chunk.choices) == 1  # one delta per chunk, as OpenAI streams calls
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                if d.id is not None:
                    assert call["id"] == d.id and d.type == "function"
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, text


def test_a_two_turn_weather_exchange(client):
    first = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert_valid_calls(first.message.tool_calls)
    call = first.message.tool_calls[0]
    history = [
        *QUESTION,
        first.message.model_dump(exclude_none=True),  # the assistant turn with its calls
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    answer = ask(client, messages=history, tool_choice="none", max_tokens=40).choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_required_makes_parallel_calls_and_honours_parallel_tool_calls_false(client):
    many = ask(client, tool_choice="required").choices[0].message.tool_calls
    assert_valid_calls(many)
    assert {json.loads(c.function.arguments)["city"] for c in many} == {"Paris", "London"}
    one = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert_valid_calls(one.message.tool_calls)


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    calls = ask(client, tool_choice=choice, temperature=1.0, seed=4).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert_valid_calls(calls)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_are_the_same_calls(client, tool_choice):
    whole = ask(client, tool_choice=tool_choice).choices[0].message.tool_calls
    calls, finish, text = streamed(client, tool_choice=tool_choice)
    assert finish == "tool_calls" and text == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


# Under "auto" the model writes a call in its own format; the regex makes this small model
# write one, so that the parser's side is what is tested.
HERMES_CALL = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'
)


def test_auto_reads_the_models_own_call_format(client):
    choice = ask(client, extra_body={"guided_regex": HERMES_CALL}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    calls, finish, text = streamed(client, extra_body={"guided_regex": HERMES_CALL})
    assert finish == "tool_calls" and text == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]


def test_auto_without_a_call_is_a_plain_answer(client):
    choice = ask(client, tool_choice="auto", max_tokens=30).choices[0]
    if choice.message.tool_calls:  # the model chose to call: then the calls are valid
        assert_valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_parse_with_a_pydantic_tool_gives_parsed_arguments(client):
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=30)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    completion = client.chat.completions.parse(
        model=MODEL,
        messages=QUESTION,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,  # one tool, asked twice: greedy, this small model repeats
        temperature=0,
        max_tokens=200,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, GetWeather) for c in calls)

"""The history's tool turns reach the chat template as Hugging Face templates read them, and a
malformed one gets a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from kvfleet.runtime.server.api_error import APIError
from kvfleet.runtime.server.tool_calls.messages import chat_message
from transformers import PreTrainedTokenizerFast

CALL = {
    "id": "call_Qx3RmW8bT2kLp9Vz1NcY7HdE",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "C"}'},
}


def test_an_assistants_calls_carry_their_arguments_as_a_mapping():
    # What the OpenAI client sends back after a call: content null, arguments a JSON string.
    message = chat_message({"role": "assistant", "content": None, "tool_calls": [CALL]}, "m")
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_Qx3RmW8bT2kLp9Vz1NcY7HdE",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}},
            }
        ],
    }


def test_a_tools_answer_keeps_its_call_id_and_joins_text_parts():
    message = chat_message(
        {
            "role": "tool",
            "tool_call_id": "call_Qx3RmW8bT2kLp9Vz1NcY7HdE",
            "content": [{"type": "text", "text": '{"temp": '}, {"type": "text", "text": "21}"}],
        },
        "messages[3]",
    )
    assert message == {
        "role": "tool",
        "tool_call_id": "call_Qx3RmW8bT2kLp9Vz1NcY7HdE",
        "content": '{"temp": 21}',
    }


def test_an_assistant_message_without_calls_is_plain_text():
    assert chat_message({"role": "assistant", "content": "Hi", "tool_calls": []}, "m") == {
        "role": "assistant",
        "content": "Hi",
    }


def test_a_qwen_style_template_renders_the_call_and_its_answer():
    # The loop Qwen2.5's template runs over a call: arguments must be a mapping for `tojson`.
    template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
        "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}"
        "{%- else %}<tool_response>{{ m.content }}</tool_response>{%- endif %}{%- endfor %}"
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer())
    messages = [
        chat_message({"role": "assistant", "content": None, "tool_calls": [CALL]}, "m[0]"),
        chat_message({"role": "tool", "tool_call_id": CALL["id"], "content": "21°C"}, "m[1]"),
    ]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert text == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}'
        "</tool_call><tool_response>21°C</tool_response>"
    )


def _tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))


def with_call(**changes: Any) -> dict[str, Any]:
    call = {**CALL, "function": dict(CALL["function"])}
    for key, value in changes.items():
        if key in ("name", "arguments"):
            call["function"][key] = value
        else:
            call[key] = value
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize(
    ("message", "param", "says"),
    [
        ({"role": "tool", "content": "21°C"}, "messages[2].tool_call_id", "got null"),
        ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[2].tool_call_id", "string"),
        ({"role": "tool", "tool_call_id": "c"}, "messages[2].content", "is required"),
        (
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url"}]},
            "messages[2].content[0]",
            "only text parts",
        ),
        ({"role": "assistant", "tool_calls": CALL}, "messages[2].tool_calls", "must be an array"),
        ({"role": "assistant", "tool_calls": ["x"]}, "messages[2].tool_calls[0]", "object"),
        (with_call(id=None), "messages[2].tool_calls[0].id", "must be a string"),
        (with_call(type="code"), "messages[2].tool_calls[0].type", "must be 'function'"),
        (with_call(function=None), "messages[2].tool_calls[0].function", "must be an object"),
        (with_call(name=3), "messages[2].tool_calls[0].function.name", "must be a string"),
        (
            with_call(arguments={"city": "Paris"}),
            "messages[2].tool_calls[0].function.arguments",
            "must be a string holding a JSON object, got object",
        ),
        (
            with_call(arguments='{"city": "Par'),
            "messages[2].tool_calls[0].function.arguments",
            "must hold a JSON object",
        ),
        (
            with_call(arguments='["Paris"]'),
            "messages[2].tool_calls[0].function.arguments",
            "must hold a JSON object, got array",
        ),
        ({"role": "assistant", "content": 5}, "messages[2].content", "must be a string"),
    ],
)
def test_a_malformed_tool_turn_is_named_in_a_400(message: dict[str, Any], param: str, says: str):
    with pytest.raises(APIError) as info:
        chat_message(message, "messages[2]")
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ") and says in info.value.message

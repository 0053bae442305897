"""Each model family's native call format read out of a finished message: the calls it made,
and every other character of its text kept as content."""

from __future__ import annotations

import pytest
from kvfleet.runtime.server.tool_calls.parsed_call import ExtractedToolCalls, ParsedToolCall
from kvfleet.runtime.server.tool_calls.parsers import TOOL_CALL_PARSERS, get_parser

hermes = get_parser("hermes")
llama = get_parser("llama3_json")
mistral = get_parser("mistral")

PARIS = ParsedToolCall("get_weather", '{"city": "Paris"}')
TOKYO_TIME = ParsedToolCall("get_time", '{"tz": "Asia/Tokyo"}')
# Qwen2.5-7B-Instruct's output, byte for byte, for "weather in Paris?" with one tool.
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'


def test_the_registry_has_vllms_names():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert all(get_parser(name).name == name for name in TOOL_CALL_PARSERS)


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'qwen'.*hermes, llama3_json, mistral"):
        get_parser("qwen")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (QWEN_CALL, ExtractedToolCalls(None, [PARIS])),
        (f"{QWEN_CALL}\n{QWEN_TIME}", ExtractedToolCalls(None, [PARIS, TOKYO_TIME])),
        (
            f"I'll look that up for you.\n\n{QWEN_CALL}",
            ExtractedToolCalls("I'll look that up for you.", [PARIS]),
        ),
        # Text after and between calls is kept too; the newlines around calls are not.
        (
            f"First:\n{QWEN_CALL}\nthen:\n{QWEN_TIME}\nDone.",
            ExtractedToolCalls("First:then:Done.", [PARIS, TOKYO_TIME]),
        ),
        # Models often stop without closing the last block.
        (QWEN_CALL.removesuffix("</tool_call>"), ExtractedToolCalls(None, [PARIS])),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Zürich", "note": "東京 ☀"}}\n</tool_call>',
            ExtractedToolCalls(
                None, [ParsedToolCall("get_weather", '{"city": "Zürich", "note": "東京 ☀"}')]
            ),
        ),
        # Escaped non-ASCII comes back as the characters themselves, as OpenAI sends them.
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}\n'
            "</tool_call>",
            ExtractedToolCalls(None, [ParsedToolCall("get_weather", '{"city": "Zürich"}')]),
        ),
        # Arguments written as a JSON string holding the object.
        (
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
            "</tool_call>",
            ExtractedToolCalls(None, [PARIS]),
        ),
    ],
)
def test_hermes_calls(text: str, expected: ExtractedToolCalls):
    assert hermes.extract(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny, 24°C.",
        "  Indented answer with a trailing newline\n",
        "Use <tool_call> tags to call tools.",  # never closed, not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut by max_tokens
        '<tool_call>\n{"tool": "get_weather"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments key
        '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',
        "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>",
    ],
)
def test_hermes_text_that_is_no_call_stays_content_unchanged(text: str):
    assert hermes.extract(text) == ExtractedToolCalls(text, [])


def test_hermes_keeps_a_broken_block_and_reads_the_good_one_after_it():
    broken = '<tool_call>\n{"name": "get_time", "arguments": {]\n</tool_call>'
    assert hermes.extract(f"{broken}\n{QWEN_CALL}") == ExtractedToolCalls(broken, [PARIS])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Llama 3.1-8B-Instruct's output with its JSON tool prompt.
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
        ('\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS]),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
            [PARIS, TOKYO_TIME],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}};'
            '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}};',
            [PARIS, TOKYO_TIME],
        ),
        (
            '{"type": "function", "name": "get_time", "parameters": {}}',
            [ParsedToolCall("get_time", "{}")],
        ),
        (
            '{"name": "search", "parameters": {"q": "crème brûlée"}}',
            [ParsedToolCall("search", '{"q": "crème brûlée"}')],
        ),
    ],
)
def test_llama3_json_calls(text: str, expected: list[ParsedToolCall]):
    assert llama.extract(text) == ExtractedToolCalls(None, expected)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        'The call would be {"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "Ada Lovelace", "born": 1815}',  # a JSON answer, no call
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        "<|python_tag|>print(42)",
        "<|python_tag|>",
        "{",
    ],
)
def test_llama3_json_text_that_is_no_call_stays_content_unchanged(text: str):
    assert llama.extract(text) == ExtractedToolCalls(text, [])


def test_llama3_json_text_after_the_calls_is_content():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI have asked for it.'
    assert llama.extract(text) == ExtractedToolCalls("I have asked for it.", [PARIS])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Mistral-7B-Instruct-v0.3 (tokenizer v3), special tokens kept in the text.
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
            ExtractedToolCalls(None, [PARIS, TOKYO_TIME]),
        ),
        (
            'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "a1b2c3d4e"}]',
            ExtractedToolCalls("Let me check.", [PARIS]),
        ),
        # Mistral Small 3.2 (v11): one marker per call, the name outside the JSON.
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_time[ARGS]{"tz": "Asia/Tokyo"}',
            ExtractedToolCalls(None, [PARIS, TOKYO_TIME]),
        ),
        # Magistral / Devstral 2 (v13): the call's id before its arguments.
        (
            '[TOOL_CALLS]get_weather[CALL_ID]x7Yq2LmN0[ARGS]{"city": "Paris"}',
            ExtractedToolCalls(None, [PARIS]),
        ),
        # [ARGS] dropped from the text with the other special tokens.
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', ExtractedToolCalls(None, [PARIS])),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Genève"}\nVoilà.',
            ExtractedToolCalls("Voilà.", [ParsedToolCall("get_weather", '{"city": "Genève"}')]),
        ),
    ],
)
def test_mistral_calls(text: str, expected: ExtractedToolCalls):
    assert mistral.extract(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Bonjour ! Il fait beau à Paris.",
        "[TOOL_CALLS]",
        "[TOOL_CALLS] I cannot call tools.",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
        "[TOOL_CALLS][]",
        '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
        "[TOOL_CALLS]get_weather[ARGS]Paris",
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        "Arrays look like [1, 2] and [ARGS] is a token.",
    ],
)
def test_mistral_text_that_is_no_call_stays_content_unchanged(text: str):
    assert mistral.extract(text) == ExtractedToolCalls(text, [])

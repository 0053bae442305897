"""A streamed message gives the same calls and content as the finished one, however the model's
text is cut into deltas, in the fragments OpenAI streams: each call's id and name first, then
its arguments; text that may start a call held back until it is known not to."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime.server.tool_calls.parsed_call import ParsedToolCall
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser
from kvfleet.runtime.server.tool_calls.parsers import get_parser

OPENAI_ID = re.compile(r"call_[A-Za-z0-9]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def stream(parser: ToolCallParser, deltas: list[str]) -> list[dict[str, Any]]:
    streamer = parser.streamer()
    fragments = [f for d in deltas for f in streamer.feed(d)]
    return fragments + streamer.finish()


def reassemble(
    fragments: list[dict[str, Any]], id_pattern: re.Pattern[str] = OPENAI_ID
) -> tuple[str | None, list[ParsedToolCall]]:
    """The content and calls a client rebuilds from the fragments, checking their shape."""
    content = ""
    names: list[str] = []
    arguments: list[str] = []
    for fragment in fragments:
        if "content" in fragment:
            assert set(fragment) == {"content"} and fragment["content"]
            content += fragment["content"]
            continue
        (call,) = fragment["tool_calls"]
        if "id" in call:  # a call's first fragment: id, type and name, no arguments yet
            assert call["index"] == len(names)
            assert id_pattern.fullmatch(call["id"])
            assert call["type"] == "function"
            assert call["function"]["arguments"] == ""
            names.append(call["function"]["name"])
            arguments.append("")
        else:
            assert call["index"] == len(names) - 1 and set(call["function"]) == {"arguments"}
            arguments[call["index"]] += call["function"]["arguments"]
    return content or None, [ParsedToolCall(n, a) for n, a in zip(names, arguments, strict=True)]


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted({p % (len(text) + 1) for p in points}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# JSON arguments with the characters that trip parsers: quotes, escapes, braces in strings.
_strings = st.text(alphabet='ab "\\{}[];,:<>/é東\n', max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | _strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_strings, inner, max_size=3),
    max_leaves=6,
)
_arguments = st.dictionaries(_strings, _json, max_size=3)
_names = st.sampled_from(["get_weather", "get_time", "search-web", "f"])


def _text(markers: list[str]) -> st.SearchStrategy[str]:
    """Plain text, and text full of pieces of the format's markers."""
    piece = st.sampled_from(markers) | st.text(alphabet='ab <>[]{}|_"\n ;é', max_size=6)
    return st.lists(piece, max_size=5).map("".join)


def _json_text(obj: Any) -> st.SearchStrategy[str]:
    return st.tuples(st.booleans(), st.booleans()).map(
        lambda f: json.dumps(obj, ensure_ascii=f[0], separators=(",", ":") if f[1] else None)
    )


@st.composite
def hermes_text(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["call", "text", "broken"]))
        if kind == "call":
            obj = {"name": draw(_names), "arguments": draw(_arguments)}
            parts.append(f"<tool_call>\n{draw(_json_text(obj))}\n</tool_call>")
        elif kind == "broken":
            parts.append('<tool_call>\n{"name": "f", "arguments": {' + draw(_strings))
        else:
            parts.append(draw(_text(["<tool_call>", "</tool_call>", "<tool_", "\n", "{", "}"])))
    return draw(st.sampled_from(["", "\n"])).join(parts)


@st.composite
def llama_text(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(_text(["<|python_tag|>", "<|python", "{", "}", '{"name": "f"', ";"]))
    calls = [
        draw(
            _json_text(
                {
                    "name": draw(_names),
                    draw(st.sampled_from(["parameters", "arguments"])): draw(_arguments),
                }
            )
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    start = draw(st.sampled_from(["", " ", "<|python_tag|>", "\n<|python_tag|> "]))
    joined = draw(st.sampled_from([";", "; ", "\n", " ;\n"])).join(calls)
    end = draw(st.sampled_from(["", ";", " ", "\nDone.", '; {"name": "f", "para']))
    return start + joined + end


@st.composite
def mistral_text(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["array", "v11", "text"]))
        if kind == "array":
            calls = [{"name": draw(_names), "arguments": draw(_arguments)} for _ in range(2)]
            parts.append(
                "[TOOL_CALLS]" + draw(st.sampled_from(["", " "])) + draw(_json_text(calls))
            )
        elif kind == "v11":
            header = draw(st.sampled_from(["[ARGS]", "", "[CALL_ID]a1b2c3d4e[ARGS]"]))
            parts.append(f"[TOOL_CALLS]{draw(_names)}{header}{draw(_json_text(draw(_arguments)))}")
        else:
            markers = ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[CALL_ID]", "get_time", "[", "{"]
            parts.append(draw(_text(markers)))
    return "".join(parts)


CASES = [
    ("hermes", hermes_text(), OPENAI_ID),
    ("llama3_json", llama_text(), OPENAI_ID),
    ("mistral", mistral_text(), MISTRAL_ID),
]


# Cut points, or None: one delta per character (as a tokenizer of single characters would).
_points = st.none() | st.lists(st.integers(0, 10_000), max_size=12)


@pytest.mark.parametrize(("name", "texts", "id_pattern"), CASES, ids=[c[0] for c in CASES])
def test_any_split_into_deltas_streams_what_extract_finds(name, texts, id_pattern):
    parser = get_parser(name)

    @settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(text=texts, points=_points)
    def check(text: str, points: list[int] | None) -> None:
        whole = parser.extract(text)
        deltas = list(text) if points is None else cut(text, points)
        assert reassemble(stream(parser, deltas), id_pattern) == (whole.content, whole.calls)

    check()


# How each format writes a list of calls after some text.
WRITERS = {
    "hermes": lambda calls: "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    ),
    "llama3_json": lambda calls: (
        "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    ),
    "mistral": lambda calls: "".join(
        f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls
    ),
}


@pytest.mark.parametrize("name", WRITERS)
def test_every_call_written_in_the_format_is_found(name: str):
    parser = get_parser(name)
    # Llama's calls are the whole message: no text before them.
    before = st.just("") if name == "llama3_json" else st.text(alphabet="abc .,é\n", max_size=9)

    @given(before=before, calls=st.lists(st.tuples(_names, _arguments), min_size=1, max_size=3))
    @settings(max_examples=30, deadline=None)
    def check(before: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
        found = parser.extract(before + WRITERS[name](calls))
        assert found.content == (before.rstrip() or None)
        assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls

    check()


def test_text_before_a_call_streams_before_the_call_is_finished():
    streamer = get_parser("hermes").streamer()
    assert streamer.feed("Let me ") == [{"content": "Let me"}]
    assert streamer.feed("check.\n\n<tool_call>\n") == [{"content": " check."}]
    assert streamer.feed('{"name": "get_weather", "arguments": {"city": ') == []
    first, arguments = streamer.feed('"Paris"}}\n</tool_call>')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert arguments == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    }
    assert streamer.finish() == []
    assert streamer.calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_a_marker_split_across_deltas_never_shows_as_content():
    deltas = ["Sure.", " <tool_", "call", ">\n", QWEN_CALL.removeprefix("<tool_call>\n")]
    content, calls = reassemble(stream(get_parser("hermes"), deltas))
    assert content == "Sure."
    assert calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_text_held_back_as_a_possible_marker_is_shown_once_it_is_not_one():
    streamer = get_parser("hermes").streamer()
    assert streamer.feed("Wrap calls in <tool_") == [{"content": "Wrap calls in"}]
    assert streamer.feed("call> tags") == []  # a block opened: it may still be a call
    assert streamer.finish() == [{"content": " <tool_call> tags"}]

    streamer = get_parser("hermes").streamer()
    assert streamer.feed("a <tool") == [{"content": "a"}]
    assert streamer.feed("s list") == [{"content": " <tools list"}]
    assert streamer.finish() == []


def test_a_plain_answer_streams_as_it_comes():
    for name in ("hermes", "llama3_json", "mistral"):
        streamer = get_parser(name).streamer()
        assert streamer.feed("The weather") == [{"content": "The weather"}]
        assert streamer.feed(" is fine.") == [{"content": " is fine."}]
        assert streamer.finish() == []


def test_a_llama_call_streams_once_its_object_closes():
    streamer = get_parser("llama3_json").streamer()
    assert streamer.feed('<|python_tag|>{"name": "get_weather", ') == []
    assert streamer.feed('"parameters": {"city": "Paris"}}') != []
    assert reassemble(streamer.finish()) == (None, [])
    assert streamer.calls == [ParsedToolCall("get_weather", '{"city": "Paris"}')]


def test_mistral_ids_suit_mistral_templates_and_differ_per_call():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    fragments = stream(get_parser("mistral"), [text])
    ids = [f["tool_calls"][0]["id"] for f in fragments if "id" in f["tool_calls"][0]]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert all(MISTRAL_ID.fullmatch(i) for i in ids)

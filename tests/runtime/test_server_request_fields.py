"""Request fields on `kvfleet serve`: `logit_bias` through the official openai client bans and
forces tokens on both endpoints, a bad bias is a 400 with `param: "logit_bias"`; fields the
server does not implement (tools, suffix, bad_words, best_of > n...) are
a 400 naming them, not silently ignored, while harmless bookkeeping fields still pass and
fields the server does not know are served and named in its log."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
from server_fixtures import HTTPResult, request

FORCED = 1234
VOCAB = 49152  # the tiny models' vocabulary (tests/tiny_models.py)
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path):
    from kvfleet.runtime import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def forced_text(offline) -> str:
    return offline.tokenizer.decode([FORCED])


def test_completion_bias_bans_and_forces_as_the_offline_api_does(tiny_client, model, offline):
    from kvfleet.runtime import SamplingParams

    prompt = "The capital of France is"
    plain = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert FORCED not in plain.token_ids
    for bias in ({plain.token_ids[0]: -100}, {FORCED: 100}):
        want = offline.generate(
            prompt, SamplingParams(temperature=0, max_tokens=5, logit_bias=bias)
        )[0].outputs[0]
        r = tiny_client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            logit_bias={str(t): v for t, v in bias.items()},
        )
        assert r.choices[0].text == want.text
        assert want.token_ids[0] != plain.token_ids[0]
    assert want.token_ids == [FORCED] * 5


def test_chat_bias_forces_the_token_streamed_or_not(tiny_client, model, forced_text):
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(FORCED): 100},
    )
    r = tiny_client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == forced_text * 4
    stream = tiny_client.chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == forced_text * 4


def body(path: str, model: str, **fields: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "max_tokens": 2, **fields}
    if path == COMPLETIONS:
        b["prompt"] = "Hello"
    else:
        b["messages"] = [{"role": "user", "content": "Hello"}]
    return b


def assert_400(r: HTTPResult, param: str, *words: str) -> None:
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], err["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"5": 101}, ["101", "[-100, 100]"]),
        ({"abc": 1}, ["'abc'", "integers"]),
        ({"-3": 1}, ["-3", ">= 0"]),
        ({"5": "high"}, ["number", "string"]),
        ({str(VOCAB): 1}, [str(VOCAB), "vocabulary"]),
        ({str(i): 1 for i in range(301)}, ["300", "301"]),
        ([[5, 1]], ["object", "array"]),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(tiny_server, model, path, bias, words):
    r = request(tiny_server.port, "POST", path, body(path, model, logit_bias=bias))
    assert_400(r, "logit_bias", *words)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "tools", [TOOL]),  # tools are the chat endpoint's
        (CHAT, "functions", [TOOL["function"]]),
        (CHAT, "function_call", "auto"),
        (COMPLETIONS, "suffix", " world"),
        (COMPLETIONS, "suffix", "none"),  # text, not the tool_choice keyword
        (COMPLETIONS, "best_of", 3),
        # vLLM's own fields that change what is generated: refused until implemented
        (CHAT, "guided_whitespace_pattern", r"[ ]?"),
        (COMPLETIONS, "bad_words", ["Paris"]),
        (COMPLETIONS, "allowed_token_ids", [1, 2]),
        (COMPLETIONS, "prompt_logprobs", 1),
        (CHAT, "truncate_prompt_tokens", 8),
        (COMPLETIONS, "use_beam_search", True),
    ],
)
def test_unsupported_field_is_a_400_naming_it(tiny_server, model, path, field, value):
    r = request(tiny_server.port, "POST", path, body(path, model, **{field: value}))
    assert_400(r, field, field, "not supported by this server")


def test_tools_on_auto_without_a_parser_are_a_bad_request_naming_the_flags(tiny_client, model):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[TOOL]
        )
    assert e.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in e.value.body["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_field_the_server_does_not_know_is_served_and_named_in_the_log(tiny_server, model, path):
    field = "kvfleet_test_unknown_" + ("chat" if path == CHAT else "completion")
    r = request(tiny_server.port, "POST", path, body(path, model, **{field: 1}))
    assert r.status == 200, r.body
    deadline = time.monotonic() + 5
    while field not in tiny_server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{path}: ignored fields this server does not know: {field}" in tiny_server.log()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_harmless_and_no_op_fields_are_accepted(tiny_server, model, path):
    fields = {
        "user": "u-1",
        "metadata": {"team": "search"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "guided_json": None,
        "use_beam_search": False,
        "bad_words": [],
        "response_format": {"type": "text"},
        "best_of": 2,
        "n": 2,
        "tools": None,
        "suffix": None,
        # what client frameworks send when no tools are wanted
        **(
            {"tools": [], "tool_choice": "none", "parallel_tool_calls": False}
            if path == CHAT
            else {}
        ),
    }
    r = request(tiny_server.port, "POST", path, body(path, model, **fields))
    assert r.status == 200, r.body
    assert len(r.json()["choices"]) == 2
    marker = "ignored fields this server does not know: "
    warned = {
        name
        for line in tiny_server.log().splitlines()
        if marker in line
        for name in line.split(marker, 1)[1].split(", ")
    }
    assert not warned & set(fields)


@pytest.mark.parametrize(
    "extra,param,message",
    [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
            "last message must be the assistant's, got role 'user'",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize'"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "must be an object"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt", "must be a boolean"),
    ],
)
def test_bad_chat_template_options_are_400s_naming_the_field(
    tiny_server, model, extra, param, message
):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = request(tiny_server.port, "POST", CHAT, body)
    assert r.status == 400
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_template_variables_and_no_generation_prompt_shape_the_prompt(tiny_client, model, offline):
    messages = [{"role": "user", "content": "hi"}]
    tok = offline.tokenizer

    def prompt_tokens(**extra: Any) -> int:
        r = tiny_client.chat.completions.create(
            model=model, messages=messages, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens

    def rendered(add_generation_prompt: bool) -> list[int]:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return tok.encode(text, add_special_tokens=False)

    with_prompt, without = rendered(True), rendered(False)
    assert len(with_prompt) > len(without)
    assert prompt_tokens() == len(with_prompt)
    assert prompt_tokens(add_generation_prompt=False) == len(without)
    # Variables the template does not use (Qwen3's enable_thinking here) are accepted.
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == len(with_prompt)


@pytest.mark.parametrize("role", [{}, [], 3])
def test_a_role_that_is_not_a_string_is_a_400(tiny_server, model, role):
    messages = [{"role": role, "content": "Hi"}]
    r = request(tiny_server.port, "POST", CHAT, {"model": model, "messages": messages})
    assert_400(r, "messages[0].role", "must be one of")


@pytest.mark.parametrize(
    "field",
    [
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"x": 1}),
    ],
)
def test_template_fields_with_a_tokenize_prompt_are_a_400(tiny_server, model, field):
    name, value = field
    r = request(
        tiny_server.port, "POST", "/tokenize", {"model": model, "prompt": "Hi", name: value}
    )
    assert_400(r, name, "messages only")

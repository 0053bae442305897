"""Structured outputs through the official openai client against `kvfleet serve` of the bundled
model: `chat.completions.parse` with twenty Pydantic models returns objects that validate, at
temperature 0 and 1; vLLM's guided_regex, guided_choice and an EBNF grammar hold on both
endpoints, streamed or not, with n > 1."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from server_fixtures import ServerProcess, running_server
from structured_models import MODELS

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(bundled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        "bundled",
        tmp_path_factory.mktemp("serve-structured"),
        "--num-threads",
        "2",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "256MiB",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=300)


def _parse(client: openai.OpenAI, model: type, temperature: float) -> object:
    fields = ", ".join(model.model_fields)
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Describe an example {model.__name__} ({fields})."},
        ],
        response_format=model,
        temperature=temperature,
        max_tokens=400,
        seed=7,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
    return choice.message.parsed


def test_parse_returns_valid_objects_for_twenty_pydantic_models_at_temperature_0_and_1(client):
    asks = [(model, temperature) for temperature in (0.0, 1.0) for model in MODELS]
    with ThreadPoolExecutor(len(asks)) as pool:  # all 40 at once: one batch, as a server sees
        parsed = list(pool.map(lambda ask: _parse(client, *ask), asks))
    for (model, temperature), obj in zip(asks, parsed, strict=True):
        assert isinstance(obj, model), (model.__name__, temperature)
        # The client's own validation passed; the schema it sent must hold as well.
        jsonschema.validate(obj.model_dump(mode="json"), model.model_json_schema())


def _chat(client, n: int = 1, stream: bool = False, **extra) -> list[str]:
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=1.0,
        seed=3,
        n=n,
        extra_body=extra,
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.message.content for c in r.choices]
    texts = [""] * n
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    return texts


def _completion(client, n: int = 1, stream: bool = False, **extra) -> list[str]:
    kwargs = dict(
        model=MODEL,
        prompt="The answer to the question is",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        n=n,
        extra_body=extra,
    )
    if not stream:
        r = client.completions.create(**kwargs)
        assert all(c.finish_reason == "stop" for c in r.choices)
        return [c.text for c in r.choices]
    texts = [""] * n
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    return texts


# Each constraint on two of the four ways to ask, the four covered across the three tests.
CHAT = pytest.param(_chat, False, id="chat")
CHAT_STREAM = pytest.param(_chat, True, id="chat-stream")
COMPLETIONS = pytest.param(_completion, False, id="completions")
COMPLETIONS_STREAM = pytest.param(_completion, True, id="completions-stream")


@pytest.mark.parametrize(("call", "stream"), [CHAT, COMPLETIONS_STREAM])
def test_guided_regex_holds(client, call, stream):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    texts = call(client, n=3, stream=stream, guided_regex=pattern)
    assert len(texts) == 3
    for text in texts:
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(("call", "stream"), [CHAT_STREAM, COMPLETIONS])
def test_guided_choice_holds(client, call, stream):
    choices = ["Paris", "London", "Rome"]
    texts = call(client, n=4, stream=stream, guided_choice=choices)
    assert len(texts) == 4 and all(t in choices for t in texts), texts


GRAMMAR = r"""
root ::= "The capital is " city "." | "I do not know."
city ::= [A-Z] [a-z]+
"""


@pytest.mark.parametrize(("call", "stream"), [CHAT_STREAM, COMPLETIONS])
def test_ebnf_grammar_holds(client, call, stream):
    texts = call(client, n=2, stream=stream, guided_grammar=GRAMMAR)
    for text in texts:
        assert re.fullmatch(r"The capital is [A-Z][a-z]+\.|I do not know\.", text), text


def test_structured_outputs_field_and_json_object_mode(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
        },
        "required": ["city", "population"],
    }
    (text,) = _chat(client, structured_outputs={"json": schema})
    jsonschema.validate(json.loads(text), schema)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of one JSON object
        assert r.choices[0].message.content.startswith("{")

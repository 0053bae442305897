"""A constraint the engine cannot enforce is the client's 400 naming the field it came in,
never a 500 and never a dead engine: invalid schemas, keywords that would not be enforced,
regexes and grammars that do not parse, bad choices, several constraints at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_fixtures import assert_error, request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def body(path: str, model: str, **fields) -> dict:
    if path == CHAT:
        return {
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            **fields,
        }
    return {"model": model, "prompt": "Hi", "max_tokens": 4, **fields}


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


BAD = [
    # (path, fields, param, words in the message)
    (CHAT, {"response_format": json_schema({"type": "nonsense"})},
     "response_format.json_schema.schema", ["not a valid JSON Schema"]),
    (CHAT, {"response_format": json_schema({"type": "object", "properties": {"a": {"not": {}}}})},
     "response_format.json_schema.schema", ["'not'", "#/properties/a"]),
    (CHAT, {"response_format": json_schema({"$ref": "#/$defs/missing"})},
     "response_format.json_schema.schema", ["missing"]),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", ["required"]),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type", ["'xml'"]),
    (CHAT, {"response_format": "json"}, "response_format", ["type"]),
    (COMPLETIONS, {"guided_json": '{"type": '}, "guided_json", ["not valid JSON"]),
    (COMPLETIONS, {"guided_json": [1, 2]}, "guided_json", ["schema object"]),
    (COMPLETIONS, {"guided_regex": "(ab"}, "guided_regex", ["parenthesis"]),
    (COMPLETIONS, {"guided_regex": "a{3,2}"}, "guided_regex", ["3 > 2"]),
    (COMPLETIONS, {"guided_regex": "a(?=b)"}, "guided_regex", ["Lookahead"]),
    (COMPLETIONS, {"guided_regex": "[^\\x00-\\U0010FFFF]+"}, "guided_regex", ["matches no text"]),
    (CHAT, {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", ["undefined_rule"]),
    (CHAT, {"guided_choice": []}, "guided_choice", ["1 to"]),
    (CHAT, {"guided_choice": ["a", 3]}, "guided_choice", ["strings"]),
    (CHAT, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ["several"]),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     ["exactly one"]),
    (CHAT, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     ["not supported"]),
    (COMPLETIONS, {"structured_outputs": {"json": {"type": "object", "if": {}, "then": {}}}},
     "structured_outputs.json", ["'if'"]),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "description": {}, "schema": {}}}},
     "response_format.json_schema.description", ["string"]),
    # inf in float32: masked logits would become NaN
    (COMPLETIONS, {"guided_regex": "[a-z]+", "temperature": 1e39}, "temperature", ["3e+38"]),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param", "words"), BAD)
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_its_field(
    tiny_server, model, path, fields, param, words
):
    r = request(tiny_server.port, "POST", path, body(path, model, **fields))
    assert_error(r, 400, param, *words)


def test_the_engine_serves_on_after_refusing_constraints(tiny_server, model):
    for path, fields, _, _ in BAD[:4]:
        request(tiny_server.port, "POST", path, body(path, model, **fields))
    r = request(tiny_server.port, "POST", CHAT, body(CHAT, model, guided_choice=["yes", "no"]))
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_schema_holding_any_json_number_is_served(tiny_server, model):
    schema = {"type": "object", "x-note": 10**20, "properties": {"a": {"const": 10**30}}}
    r = request(tiny_server.port, "POST", COMPLETIONS, body(COMPLETIONS, model, guided_json=schema,
                                                            max_tokens=40))  # fmt: skip
    assert r.status == 200, r.body


def test_a_constraint_no_token_can_write_ends_that_request_alone(tiny_server, model):
    # A character the tiny models' vocabulary cannot spell: the request fails with a message
    # saying so; the engine serves on.
    r = request(tiny_server.port, "POST", COMPLETIONS,
                body(COMPLETIONS, model, guided_regex="\U0006649B"))  # fmt: skip
    if r.status != 200:  # a vocabulary that can spell it serves it
        err = assert_error(r, 500, None)
        assert "no token of the model's vocabulary can continue" in err["message"]
    ok = request(tiny_server.port, "POST", CHAT, body(CHAT, model, guided_choice=["a", "b"]))
    assert ok.status == 200, ok.body

"""vLLM's /tokenize and /detokenize on `kvfleet serve`: counts that match what generation
uses, a round trip back to text, and 4xx errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_fixtures import request

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    from kvfleet.runtime.models.tokenizer_loader import load_tokenizer

    return load_tokenizer(tiny_llama_dir)


def post(server, path: str, body: dict):
    r = request(server.port, "POST", path, body)
    return r.status, r.json()


def test_tokenize_counts_what_a_completion_is_charged(tiny_server, tiny_client, model, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    status, got = post(tiny_server, "/tokenize", {"model": model, "prompt": prompt})
    assert status == 200
    assert got["tokens"] == tokenizer(prompt).input_ids
    assert got["count"] == len(got["tokens"]) and got["token_strs"] is None
    assert got["max_model_len"] > got["count"]
    used = tiny_client.completions.create(model=model, prompt=prompt, max_tokens=1).usage
    assert used.prompt_tokens == got["count"]


def test_tokenize_renders_messages_as_chat_does(tiny_server, tiny_client, model):
    status, got = post(tiny_server, "/tokenize", {"model": model, "messages": MESSAGES})
    assert status == 200
    used = tiny_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage
    assert used.prompt_tokens == got["count"]
    _, bare = post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["count"] < got["count"]  # no opened assistant turn


def test_token_strings_and_the_round_trip(tiny_server, tokenizer):
    text = "Hello, world! Ça va?"
    _, got = post(tiny_server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    status, back = post(tiny_server, "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back == {"prompt": text}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, "two"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(tiny_server, path, body, status, param):
    code, got = post(tiny_server, path, body)
    assert code == status
    assert got["error"]["param"] == param and got["error"]["message"]

"""Bad input and limits on `kvfleet serve`: every error has OpenAI's shape and the right status
(400, 401, 404, 413, 503 + Retry-After); the queue gauges rise under load and fall back."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_fixtures import (
    HTTPResult,
    ServerProcess,
    assert_error,
    metric,
    request,
    running_server,
    scrape,
    wait_for_metric,
)

from kvfleet import contract

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough that a stream of most of it outlasts a few /metrics scrapes on a busy host.
MAX_MODEL_LEN = 1024
MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve-limits"),
        "--api-key",
        KEY,
        "--max-waiting-requests",
        "1",
        "--max-num-seqs",
        "1",
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def post(server: ServerProcess, path: str, body: object, **headers: str) -> HTTPResult:
    return request(server.port, "POST", path, body, headers={**AUTH, **headers})


def test_api_key_is_required_on_the_api_only(server, model):
    for path in ("/v1/models",):
        assert_error(request(server.port, "GET", path), 401)
        bad = request(server.port, "GET", path, headers={"Authorization": "Bearer wrong"})
        assert_error(bad, 401)
        assert request(server.port, "GET", path, headers=AUTH).status == 200
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    assert_error(request(server.port, "POST", "/v1/completions", body), 401)
    # The tokenizer endpoints reveal the model's tokenizer: they are behind the key too.
    assert_error(request(server.port, "POST", "/tokenize", {"prompt": "hi"}), 401)
    assert_error(request(server.port, "POST", "/detokenize", {"tokens": [1]}), 401)
    assert request(server.port, "POST", "/tokenize", {"prompt": "hi"}, headers=AUTH).status == 200
    for path in (
        contract.HEALTH_PATH,
        contract.METRICS_PATH,
        contract.VERSION_PATH,
        "/openapi.json",
    ):
        assert request(server.port, "GET", path).status == 200
    client = openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0)
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens


def test_malformed_json_and_non_object_bodies_are_400(server):
    assert_error(post(server, "/v1/completions", b'{"prompt": "x", '), 400, None, "JSON")
    assert_error(post(server, "/v1/chat/completions", b"[1, 2]"), 400, None, "object")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", ["integer", "string"]),
        ({"prompt": "x", "temperature": "hot"}, "temperature", ["number"]),
        ({"prompt": "x", "stream": "yes"}, "stream", ["boolean"]),
        ({"prompt": "x", "n": True}, "n", ["integer"]),
        ({"prompt": 5}, "prompt", ["prompt"]),
        ({"prompt": []}, "prompt", ["non-empty"]),
        ({}, "prompt", ["required"]),
        ({"prompt": "x", "stop": [1]}, "stop", ["string"]),
        ({"prompt": "x", "temperature": -1}, "temperature", [">= 0", "-1"]),
        ({"prompt": "x", "top_p": 0}, "top_p", ["(0, 1]"]),
        ({"prompt": "x", "n": 0}, "n", [">= 1"]),
        ({"prompt": "x", "n": 65}, "n", ["64"]),
        ({"prompt": "x", "logprobs": 21}, "logprobs", ["20"]),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", ["[-2, 2]"]),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", [">= 1"]),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
        ({"prompt": [10**9]}, "prompt", ["token ids"]),
        ({"prompt": "x", "max_tokens": 2000}, "max_tokens", ["2000", str(MAX_MODEL_LEN)]),
        ({"prompt": "x " * 1100}, "prompt", [str(MAX_MODEL_LEN)]),  # within the body limit
        ({"prompt": [5] * 1100}, "prompt", [str(MAX_MODEL_LEN)]),
    ],
)
def test_invalid_completion_requests_are_400_naming_the_field(server, model, body, param, words):
    r = post(server, "/v1/completions", {"model": model, **body})
    assert_error(r, 400, param, *words)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "messages", ["non-empty"]),
        ({"messages": "hi"}, "messages", ["array"]),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["robot"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            ["text"],
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            ["logprobs"],
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2000},
            "max_tokens",
            ["2000", str(MAX_MODEL_LEN)],
        ),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_field(server, model, body, param, words):
    r = post(server, "/v1/chat/completions", {"model": model, **body})
    assert_error(r, 400, param, *words)


def test_the_openai_client_sees_typed_errors(server, model):
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="x", max_tokens=2000)
    assert "2000" in str(exc.value) and str(MAX_MODEL_LEN) in str(exc.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_unknown_model_and_route_are_404(server):
    err = assert_error(
        post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "gpt-4"
    )
    assert err["code"] == "model_not_found"
    assert_error(request(server.port, "GET", "/v1/nothing", headers=AUTH), 404)


def test_body_over_the_limit_is_413(server, model):
    r = post(server, "/v1/completions", {"model": model, "prompt": "x" * (MAX_BODY + 10)})
    err = assert_error(r, 413, None, str(MAX_BODY))
    assert err["code"] == "body_too_large"


def _open_stream(
    server: ServerProcess, model: str, max_tokens: int
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "model": model,
        "prompt": "Keep going",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_back_pressure_503_and_queue_gauges_rise_and_fall(server, model):
    first_conn, _ = _open_stream(server, model, MAX_MODEL_LEN - 8)
    wait_for_metric(server, contract.NUM_REQUESTS_RUNNING, lambda v: v == 1)
    _, second = _open_stream(server, model, 20)  # max-num-seqs 1: it waits
    wait_for_metric(server, contract.NUM_REQUESTS_WAITING, lambda v: v == 1)
    r = post(server, "/v1/completions", {"model": model, "prompt": "one more", "max_tokens": 2})
    err = assert_error(r, 503, None, "--max-waiting-requests 1")
    assert err["code"] == "queue_full"
    assert int(r.headers["retry-after"]) >= 1
    first_conn.sock.close()  # hang up: the waiting request gets the slot
    wait_for_metric(server, contract.NUM_REQUESTS_WAITING, lambda v: v == 0)
    text = second.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    wait_for_metric(server, contract.NUM_REQUESTS_RUNNING, lambda v: v == 0)
    assert metric(scrape(server), contract.KV_CACHE_USAGE_PERC) == 0
    ok = post(server, "/v1/completions", {"model": model, "prompt": "now", "max_tokens": 2})
    assert ok.status == 200

"""Inputs that once took `kvfleet serve` down or escaped as plain-text 500s: each is now a 4xx in
OpenAI's shape naming the field, and the next normal request still answers. Also: an engine
that cannot go on makes the process exit (so that it is restarted), and an empty API key is a
start-up error, not "no authentication"."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import (
    HTTPResult,
    ServerProcess,
    assert_error,
    metric,
    open_stream,
    read_events,
    request,
    running_server,
    scrape,
    start_server,
)

from kvfleet import contract

MAX_MODEL_LEN = 256
MAX_WAITING = 8
VOCAB = 49152  # the tiny model's


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve-hardening"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-waiting-requests",
        str(MAX_WAITING),
    ) as s:
        yield s


def post(server: ServerProcess, path: str, body: object, **headers: str) -> HTTPResult:
    return request(server.port, "POST", path, body, headers=headers)


def assert_still_serving(server: ServerProcess) -> None:
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert ok.status == 200, ok.body
    assert ok.json()["usage"]["completion_tokens"] == 3
    assert request(server.port, "GET", contract.HEALTH_PATH).status == 200


@pytest.mark.parametrize("top_k", [10**20, 2**63, VOCAB + 1, -2])
def test_out_of_range_top_k_is_a_400_and_the_engine_lives_on(server, top_k):
    for stream in (False, True):
        body = {"prompt": "hi", "max_tokens": 2, "top_k": top_k, "stream": stream}
        assert_error(post(server, "/v1/completions", body), 400, "top_k")
    assert_still_serving(server)


def test_top_k_of_the_whole_vocabulary_or_off_is_accepted(server):
    for top_k in (VOCAB, 0, -1):
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": top_k})
        assert r.status == 200, r.body


@pytest.mark.parametrize("seed", [10**20, 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_a_400_streamed_or_not(server, seed):
    for path, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        for stream in (False, True):
            body = {**extra, "max_tokens": 2, "seed": seed, "n": 2, "stream": stream}
            assert_error(post(server, path, body), 400, "seed", "64-bit")
    assert_still_serving(server)


def test_seeds_at_the_int64_edges_give_every_completion(server):
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "hi", "max_tokens": 3, "seed": seed, "n": 3}
        r = post(server, "/v1/completions", body)
        assert r.status == 200, r.body
        assert len(r.json()["choices"]) == 3
        _, resp = open_stream(server.port, "/v1/completions", {**body, "stream": True})
        assert read_events(resp)[-1] == "[DONE]"


def test_admission_counts_prompts_times_n(server):
    # 3 prompts x n=3 = 9 sequences: more than the 8 this server ever queues, so no retry can
    # succeed: a 400, not a 503.
    body = {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}
    err = assert_error(post(server, "/v1/completions", body), 400, "n", "9 sequences", "8")
    assert err["code"] == "too_many_sequences"
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 9, "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "n", "9 sequences")
    ok = post(server, "/v1/completions", {**body, "prompt": ["a", "b"], "n": 4})
    assert ok.status == 200 and len(ok.json()["choices"]) == 8


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt[1]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x\ud800"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content[0].text",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where_it_is(server, path, body, param):
    # json.dumps writes the lone surrogate as the escape "\ud800", which JSON allows.
    raw = json.dumps({"max_tokens": 2, **body} if path != "/tokenize" else body).encode()
    err = assert_error(post(server, path, raw), 400, param, "surrogate")
    assert err["code"] == "invalid_unicode"
    assert_still_serving(server)


def test_a_proper_surrogate_pair_is_text(server):
    raw = json.dumps({"prompt": "smile \U0001f600"}).encode()  # sent as "\ud83d\ude00"
    assert b"\\ud83d\\ude00" in raw
    r = post(server, "/tokenize", raw)
    assert r.status == 200 and r.json()["count"] >= 2


@pytest.mark.parametrize("depth", [33, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    raw = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    assert_error(post(server, "/v1/completions", raw), 400, None, "nested deeper than 32")
    assert_still_serving(server)


def test_a_prompt_too_long_to_fit_is_refused_by_its_length_alone(server):
    started = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "ab" * 400_000, "max_tokens": 1})
    err = assert_error(r, 400, "prompt", "800000 characters", str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "ab" * 400_000}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "messages", "characters")
    # Refused before tokenizing 800k characters (which alone takes about half a second here).
    assert time.monotonic() - started < 5


def test_a_tiny_temperature_is_greedy_not_empty_text(server):
    base = {"prompt": "The weather today", "max_tokens": 8, "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**base, "temperature": 0}).json()
    for t in (1e-300, 1e-9):
        tiny = post(server, "/v1/completions", {**base, "temperature": t}).json()
        assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"] != ""


@pytest.mark.parametrize("penalty", [1e-300, 0.0, 1e300])
def test_repetition_penalty_outside_its_range_is_a_400(server, penalty):
    body = {"prompt": "x", "max_tokens": 3, "repetition_penalty": penalty}
    assert_error(post(server, "/v1/completions", body), 400, "repetition_penalty", "[0.01, 100]")


def test_content_null_is_refused_except_for_an_assistant_turn(server):
    user_null = {"messages": [{"role": "user", "content": None}], "max_tokens": 2}
    assert_error(
        post(server, "/v1/chat/completions", user_null), 400, "messages[0].content", "user"
    )
    missing = {"messages": [{"role": "system"}], "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", missing), 400, "messages[0].content")
    assistant_null = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 2,
    }
    assert post(server, "/v1/chat/completions", assistant_null).status == 200


def test_a_custom_chat_template_is_refused_not_ignored(server):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}
    err = assert_error(post(server, "/v1/chat/completions", body), 400, "chat_template")
    assert err["code"] == "unsupported_parameter"
    tok = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}
    assert_error(post(server, "/tokenize", tok), 400, "chat_template")


def test_aiohttp_s_own_errors_are_openai_errors(server):
    big_header = request(server.port, "GET", "/v1/models", headers={"X-Big": "a" * 20_000})
    err = assert_error(big_header, 400, None, "8190")
    assert err["code"] == "bad_http_request"
    assert_error(request(server.port, "GET", "/v1/completions"), 405, None)
    assert_error(request(server.port, "GET", "/nowhere"), 404, None)
    assert_still_serving(server)


def test_after_all_of_it_nothing_is_left_running_or_held(server):
    assert_still_serving(server)
    samples = scrape(server)
    assert metric(samples, contract.NUM_REQUESTS_RUNNING) == 0
    assert metric(samples, contract.NUM_REQUESTS_WAITING) == 0
    assert metric(samples, contract.KV_CACHE_USAGE_PERC) == 0


# --- start-up and engine death (their own processes) ------------------------------------------
@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (("--api-key", ""), {}, "--api-key is empty"),
        ((), {contract.API_KEY_ENV: ""}, f"${contract.API_KEY_ENV} is set but empty"),
        ((), {contract.API_KEY_ENV: "  "}, "empty"),
    ],
)
def test_an_empty_api_key_is_a_start_up_error(tmp_path: Path, args, env, words):
    server = start_server("random:tiny", tmp_path, *args, env=env)
    assert server.proc.wait(60) == 2
    assert words in server.log()


LAUNCHER = Path(__file__).with_name("serve_with_faults.py")


@pytest.fixture(scope="module")
def faulty_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server with the faults of serve_with_faults.py armed (the engine-stopping one aside)."""
    log_dir = tmp_path_factory.mktemp("serve-faults")
    server = start_server(tiny_llama_dir, log_dir, launcher=LAUNCHER)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.terminate()


def test_a_request_the_engine_fails_gets_a_500_and_nobody_else_notices(faulty_server):
    from serve_with_faults import SAMPLER_FAULT

    server = faulty_server
    body = {"prompt": "Keep going", "max_tokens": 40, "ignore_eos": True, "stream": True}
    _conn, bystander = open_stream(server.port, "/v1/completions", body)
    assert read_events(bystander, 1)
    bad = {"prompt": "hi", "max_tokens": 5, "stop": [SAMPLER_FAULT], "n": 2}
    err = assert_error(post(server, "/v1/completions", bad), 500, None, "injected sampler fault")
    assert err["code"] == "request_failed" and err["type"] == "server_error"
    _, resp = open_stream(server.port, "/v1/completions", {**bad, "stream": True})
    events = read_events(resp)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_failed"
    chat = {"messages": [{"role": "user", "content": "x"}], "stop": SAMPLER_FAULT, "stream": True}
    _, resp = open_stream(server.port, "/v1/chat/completions", chat)
    assert read_events(resp)[-1] == "[DONE]"

    rest = read_events(bystander)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert_still_serving(server)
    samples = scrape(server)
    errors = metric(samples, f"{contract.REQUEST_SUCCESS}_total", finished_reason="error")
    assert errors == 5  # n=2, n=2 streamed, one chat
    assert metric(samples, contract.KV_CACHE_USAGE_PERC) == 0


def test_an_unexpected_exception_is_a_500_in_openai_shape(faulty_server):
    from serve_with_faults import ENCODE_FAULT

    server = faulty_server
    for path, body in (
        ("/v1/completions", {"prompt": f"x{ENCODE_FAULT}"}),
        ("/v1/completions", {"prompt": f"x{ENCODE_FAULT}", "stream": True}),
        ("/tokenize", {"prompt": ENCODE_FAULT}),
    ):
        err = assert_error(post(server, path, body), 500, None, "internal error")
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        # The message names the request in the log, where the traceback is.
        request_id = err["message"].split()[2]
        assert f"internal error {request_id}" in server.log()
    assert "KeyError: 'injected encode fault'" in server.log()
    assert_still_serving(server)


def test_tokenizing_does_not_block_health_or_other_requests(faulty_server):
    import threading

    from serve_with_faults import SLOW_ENCODE, SLOW_ENCODE_S

    server = faulty_server
    slow: list[HTTPResult] = []
    thread = threading.Thread(
        target=lambda: slow.append(
            post(server, "/v1/completions", {"prompt": f"x{SLOW_ENCODE}", "max_tokens": 1})
        )
    )
    started = time.monotonic()
    thread.start()
    time.sleep(0.5)  # the slow prompt is being tokenized now
    for _ in range(5):
        assert request(server.port, "GET", contract.HEALTH_PATH, timeout=1).status == 200
        assert request(server.port, "GET", contract.METRICS_PATH, timeout=1).status == 200
    assert time.monotonic() - started < SLOW_ENCODE_S - 0.5
    thread.join(30)
    assert slow[0].status == 200


def test_an_engine_fault_ends_streams_with_an_error_and_the_process_exits(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from serve_with_faults import FAULT_TOKEN

    server = start_server(tiny_llama_dir, tmp_path, launcher=LAUNCHER)
    try:
        server.wait_healthy()
        body = {"prompt": "A long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
        _conn, resp = open_stream(server.port, "/v1/completions", body)
        assert read_events(resp, 2)
        r = post(server, "/v1/completions", {"prompt": [1, FAULT_TOKEN], "max_tokens": 2})
        assert_error(r, 503, None, "forward-pass fault")
        events = read_events(resp)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_unavailable" and "forward-pass fault" in err["message"]
        assert server.proc.wait(30) == 1
        assert "exiting so that the process is restarted" in server.log()
    finally:
        server.terminate()


def test_streamed_chunks_are_compact_utf8_json(server):
    # As OpenAI's API writes them: no spaces after separators, non-ASCII text as itself.
    body = {"prompt": "café ☕", "echo": True, "max_tokens": 1, "stream": True}
    _, resp = open_stream(server.port, "/v1/completions", body)
    first = read_events(resp, 1)[0]
    assert "café ☕" in first and "\\u" not in first
    assert json.loads(first)["choices"][0]["text"] == "café ☕"
    assert ", " not in first.replace("café ☕", "") and '": ' not in first

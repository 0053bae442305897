"""A hostile client against a real `kvfleet serve`: Hypothesis writes OpenAI request bodies —
valid, type-confused, out of range, huge, unicode-hostile — and sends them over HTTP. Whatever
it sends: never a 5xx, every error an OpenAI error object, every stream ends with [DONE]; and
afterwards a normal request answers and nothing is left running, waiting or holding KV blocks.

Hand-written strategies rather than schemathesis: the server publishes no OpenAPI document,
and the bodies that broke it were not schema violations but values a schema allows (an integer
past int64, a lone surrogate in a string, nesting) — so the strategies aim there on purpose.
The bodies that once broke the server are pinned with @example.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from server_fixtures import ServerProcess, metric, running_server, scrape

from kvfleet import contract

MAX_MODEL_LEN = 128
MAX_WAITING = 64

# --- values --------------------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, 2, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**20, 49152, 49153]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-9, 1e300, 5e-324, 2.0, -2.0, float("nan"), float("inf")]
HOSTILE_TEXT = ["", "\ud800", "a\udfffb", "\x00", "\U0001f600" * 50, "\u202e", "<|im_end|>"]

# Every character, lone surrogates included (Hypothesis leaves them out unless asked).
any_text = st.text(st.characters(exclude_categories=()), max_size=40)
plain_text = st.text(max_size=40)
text = st.one_of(plain_text, any_text, st.sampled_from(HOSTILE_TEXT))
ints = st.one_of(st.integers(-3, 300), st.integers(), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(-5, 5), st.floats(), st.sampled_from(EDGE_FLOATS))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
)


def bodies(fields: dict[str, st.SearchStrategy], hostile: bool) -> st.SearchStrategy:
    """Request bodies from per-field strategies of plausible values. Hostile ones give any
    field, sometimes, any value at all: a wrong type, a huge number, a lone surrogate."""
    if hostile:
        fields = {k: st.one_of(v, junk) for k, v in fields.items()}
    required = {k: v for k, v in fields.items() if k in ("prompt", "messages")}
    optional = {k: v for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional)


valid_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)
prompt = st.one_of(
    plain_text.filter(bool),
    st.lists(plain_text.filter(bool), min_size=1, max_size=3),
    valid_ids,
    st.lists(valid_ids, min_size=1, max_size=3),
    st.just("x" * 200_000),  # huge: refused by its length alone
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "developer"]),
        "content": st.one_of(
            plain_text,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text})),
        ),
    }
)
messages = st.lists(message, min_size=1, max_size=3).map(
    lambda ms: [*ms[:-1], {**ms[-1], "role": "user"}]
)
SAMPLING = {
    "n": st.integers(1, 4),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from(EDGE_FLOATS[:6])),
    "top_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-1, 60), st.sampled_from(EDGE_INTS)),
    "min_p": st.floats(0, 1),
    "seed": ints,
    "max_tokens": st.integers(1, 24),
    "min_tokens": st.integers(0, 4),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 3),
    "stop": st.one_of(plain_text.filter(bool), st.lists(plain_text.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100)),
    "stream": st.booleans(),
    "user": plain_text,
}
COMPLETION = {
    "prompt": prompt,
    **SAMPLING,
    "echo": st.booleans(),
    "logprobs": st.integers(0, 20),
}
CHAT = {
    "messages": messages,
    **SAMPLING,
    "logprobs": st.booleans(),
    "max_completion_tokens": st.integers(1, 24),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), junk),
    "add_generation_prompt": st.booleans(),
}
tokenize = st.one_of(
    bodies({"prompt": text, "add_special_tokens": st.booleans()}, hostile=True),
    bodies({"messages": messages}, hostile=True),
)
cases = st.one_of(
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, hostile=False)),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, hostile=False)),
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, hostile=True)),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, hostile=True)),
    st.tuples(st.just("/tokenize"), tokenize),
    st.tuples(st.just("/detokenize"), bodies({"tokens": st.lists(ints, max_size=8)}, True)),
    st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
        st.one_of(junk, st.binary(max_size=64)),  # not an object, or not JSON at all
    ),
)


# --- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve-fuzz"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-waiting-requests",
        str(MAX_WAITING),
    ) as s:
        yield s


def _send(server: ServerProcess, path: str, payload: Any) -> tuple[int, str, bytes]:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def _assert_openai_error(body: bytes) -> None:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]


def _assert_stream(body: bytes) -> None:
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-300:]
    for e in events[:-1]:
        chunk = json.loads(e)
        if "error" in chunk:
            pytest.fail(f"stream ended with an error: {chunk}")


DEFECTS = [
    # top_k past int64 stopped the engine for good.
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 10**20}),
    # seed past int64 (also seed + index): a plain 500, or a stream cut off with no [DONE].
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 10**20}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 10**20, "stream": True}),
    # prompts x n past the queue: a 503 that could never succeed.
    ("/v1/completions", {"prompt": ["a"] * 256, "n": 64, "max_tokens": 1}),
    # lone surrogates: a tokenizer TypeError, 500.
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ("/tokenize", {"prompt": "\ud800"}),
    # JSON nested 100k deep: RecursionError, 500.
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    # temperature / repetition_penalty 1e-300: empty text, or inf logits.
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 1e-300}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "repetition_penalty": 1e-300}),
    # content null in a user message was accepted; chat_template was silently ignored.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": ""}),
]


def _pinned(test):  # type: ignore[no-untyped-def]
    for path, payload in DEFECTS:
        test = example(case=(path, payload))(test)
    return test


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same bodies on every run: a CI failure is reproducible
)
@_pinned
@given(case=cases)
def test_no_body_gets_a_5xx_and_every_answer_is_well_formed(
    server: ServerProcess, case: tuple[str, Any]
) -> None:
    path, payload = case
    status, content_type, body = _send(server, path, payload)
    reason = json.loads(body)["error"]["message"][:40] if status >= 400 else ""
    event(f"{path} {status} {reason}")
    assert status < 500, (status, body[:500])
    if status >= 400:
        assert content_type.startswith("application/json"), (status, body[:200])
        _assert_openai_error(body)
    elif content_type.startswith("text/event-stream"):
        _assert_stream(body)
    else:
        json.loads(body)


def test_afterwards_it_still_answers_and_holds_nothing(server: ServerProcess) -> None:
    status, _, body = _send(
        server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    )
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    samples = scrape(server)
    assert metric(samples, contract.NUM_REQUESTS_RUNNING) == 0
    assert metric(samples, contract.NUM_REQUESTS_WAITING) == 0
    assert metric(samples, contract.KV_CACHE_USAGE_PERC) == 0
    assert "Traceback" not in server.log()

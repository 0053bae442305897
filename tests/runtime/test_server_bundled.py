"""`kvfleet serve` with the bundled SmolLM2-135M-Instruct: the answers a user checks by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvfleet.runtime.engine.served_name import BUNDLED_NAME
from server_fixtures import ServerProcess, running_server, scrape

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(bundled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        "bundled",
        tmp_path_factory.mktemp("serve-bundled"),
        "--num-threads",
        "2",
        "--max-model-len",
        "1024",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=120)


def test_a_fresh_server_shows_no_traffic_in_its_metrics(server):
    # The warm-up generation that gates /health is not user traffic: it must not show.
    # (First in this module: later tests send requests.)
    samples = scrape(server)
    traffic = [
        value
        for (name, _), value in samples.items()
        if name
        in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count",
        )
    ]
    assert traffic and all(v == 0 for v in traffic), samples


def test_models_lists_the_bundled_name(client):
    assert [m.id for m in client.models.list().data] == [BUNDLED_NAME]


def test_chat_answers_paris(client):
    r = client.chat.completions.create(
        model=BUNDLED_NAME, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert "Paris" in r.choices[0].message.content
    # It ended on the model's end-of-turn token: finish_reason stop, no stop_reason (as vLLM).
    choice = r.model_dump()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice.get("stop_reason") is None


def test_streamed_chat_answers_paris_and_stops_on_its_own(client):
    stream = client.chat.completions.create(
        model=BUNDLED_NAME, messages=QUESTION, max_tokens=64, temperature=0, stream=True
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris" in text
    assert chunks[-1].choices[0].finish_reason == "stop"  # end-of-turn, not the token limit


def test_continue_final_message_extends_the_assistants_answer(client):
    # vLLM's extra chat fields: the reply continues the assistant's last message rather than
    # starting a new turn, e.g. to prefill the first words of an answer.
    r = client.chat.completions.create(
        model=BUNDLED_NAME,
        messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}],
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    text = r.choices[0].message.content
    assert "Paris" in text and not text.lstrip().startswith("The capital")

"""`kvfleet serve --stream-interval K`: a streamed completion's tokens go out K at a time (its
first and its last at once), and nothing else changes: the same text, tokens, logprobs and
finish as token by token."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfleet.runtime.cli import main
from kvfleet.runtime.engine.core_messages import CoreRequest, SequenceOutput
from kvfleet.runtime.engine.output_processor import OutputProcessor, RequestDelta
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.token_logprob import TokenLogprob
from server_fixtures import running_server


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _run(tokenizer, interval: int, steps: list[list[int]], params: SamplingParams):
    """The deltas one sequence yields when the core sends `steps` (its new tokens, step by
    step; the last step ends it with "length"), and what the processor asked the core to abort."""
    outputs = OutputProcessor(tokenizer, stream_interval=interval)
    deltas: list[RequestDelta] = []
    outputs.add(
        0, [CoreRequest("g#0", [1, 2], params, frozenset(), 64, "g", 0, 0.0)], deltas.append
    )
    aborts = {}
    for i, tokens in enumerate(steps):
        last = i == len(steps) - 1
        logprobs = [TokenLogprob(t, -0.5, []) for t in tokens]
        out = SequenceOutput("g#0", tokens, logprobs, "length" if last else None)
        aborts.update(outputs.process([out], now=float(i)))
        if deltas and deltas[-1].finished:
            break
    return [d.completions[0] for d in deltas if d.completions], aborts


def _joined(completions) -> tuple[str, list[int], list[TokenLogprob]]:
    text = "".join(c.text for c in completions)
    tokens = [t for c in completions for t in c.token_ids]
    logprobs = [lp for c in completions for lp in c.logprobs]
    return text, tokens, logprobs


def test_tokens_go_out_k_at_a_time_first_and_last_at_once(tokenizer) -> None:
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert len(ids) >= 8
    steps = [[t] for t in ids[:8]]
    params = SamplingParams(max_tokens=8, logprobs=0)
    each, _ = _run(tokenizer, 1, steps, params)
    paced, _ = _run(tokenizer, 3, steps, params)
    assert [len(c.token_ids) for c in each] == [1] * 8
    assert [len(c.token_ids) for c in paced] == [1, 3, 3, 1]
    assert _joined(paced) == _joined(each)
    assert paced[-1].finish_reason == "length" == each[-1].finish_reason
    # A verify step brings several tokens at once: they go when they reach the interval.
    bursts = [ids[0:1], ids[1:3], ids[3:4], ids[4:7], ids[7:8]]
    grouped, _ = _run(tokenizer, 2, bursts, params)
    assert [len(c.token_ids) for c in grouped] == [1, 2, 4, 1]
    assert _joined(grouped) == _joined(each)


@settings(max_examples=60, deadline=None)
@given(
    bursts=st.lists(st.integers(1, 3), min_size=1, max_size=12),
    interval=st.integers(1, 5),
)
def test_any_steps_and_interval_give_the_same_completion(tokenizer, bursts, interval) -> None:
    """However the tokens arrive, the held deltas join to the token-by-token completion; the
    first goes with the first step, and every one between first and last brings >= K tokens."""
    ids = tokenizer.encode(" a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5")
    steps, start = [], 0
    for size in bursts:
        steps.append(ids[start : start + size])
        start += size
    params = SamplingParams(max_tokens=64, logprobs=0)
    each, _ = _run(tokenizer, 1, steps, params)
    paced, _ = _run(tokenizer, interval, steps, params)
    assert _joined(paced) == _joined(each)
    assert paced[0].token_ids == steps[0]
    assert all(len(c.token_ids) >= interval for c in paced[1:-1])
    assert paced[-1].finish_reason == "length"


def test_a_stop_string_found_while_tokens_are_held_ends_the_completion_as_before(tokenizer):
    ids = tokenizer.encode(" one two three four five six seven", add_special_tokens=False)
    steps = [[t] for t in ids]
    params = SamplingParams(max_tokens=64, stop=[" five"])
    each, each_aborts = _run(tokenizer, 1, steps, params)
    paced, paced_aborts = _run(tokenizer, 4, steps, params)
    assert _joined(paced)[0] == _joined(each)[0] == " one two three four"
    assert paced[-1].finish_reason == each[-1].finish_reason == "stop"
    assert paced_aborts == each_aborts == {"stop": ["g#0"]}
    assert len(paced) < len(each)


def test_an_interval_below_one_is_refused_naming_the_flag(capsys) -> None:
    assert main(["serve", "--stream-interval", "0"]) == 2
    assert "stream_interval: must be >= 1, got 0" in capsys.readouterr().err


def test_a_server_streams_the_same_completion_in_fewer_chunks(tiny_llama_dir, tmp_path) -> None:
    with running_server(tiny_llama_dir, tmp_path, "--stream-interval", "4") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none")
        model = client.models.list().data[0].id
        args = {"model": model, "prompt": "Stream this", "max_tokens": 13, "temperature": 0}
        args["extra_body"] = {"ignore_eos": True}
        full = client.completions.create(**args)
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = list(client.completions.create(**args, stream=True, stream_options=options))
    choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in choices) == full.choices[0].text
    # 13 tokens: the first alone, then 4 at a time, the last 0-3 with the finish.
    counts = [c.usage.completion_tokens for c in choices]
    assert counts[:4] == [1, 5, 9, 13] and len(choices) <= 5
    assert choices[-1].choices[0].finish_reason == "length"

"""`/v1/completions` with `echo` and `logprobs` through the official openai tiny_client: the prompt
is scored and its tokens come first in OpenAI's legacy logprobs shape, streaming and not."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog because"
MAX_TOKENS = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_client: openai.OpenAI) -> str:
    return tiny_client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path):
    from kvfleet.runtime import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def scored(offline):
    """The engine's own prompt logprobs for PROMPT (top 2), and its prompt token ids."""
    from kvfleet.runtime import SamplingParams

    (out,) = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))
    return out.prompt_token_ids, out.prompt_logprobs


def _args(**kw: object) -> dict[str, object]:
    return {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
        **kw,
    }


def _check_prompt_part(lp, offline, scored) -> None:
    ids, entries = scored
    text = offline.tokenizer.decode
    n = len(ids)
    assert lp.tokens[:n] == [text([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        got = lp.token_logprobs[i]
        assert math.isfinite(got) and got <= 0
        assert got == pytest.approx(entries[i].logprob, abs=TOL)
        want_top = {text([t]): v for t, v in entries[i].top}
        assert lp.top_logprobs[i] == pytest.approx(want_top, abs=TOL)


def test_echo_with_logprobs_scores_the_prompt_first(tiny_client, model, offline, scored) -> None:
    r = tiny_client.completions.create(model=model, **_args())
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(scored[0])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + MAX_TOKENS
    _check_prompt_part(lp, offline, scored)
    # The generated part: greedy picks the best alternative, offsets run on from the prompt.
    for chosen, top in zip(lp.token_logprobs[n:], lp.top_logprobs[n:], strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert choice.text.startswith(PROMPT)
    assert "".join(lp.tokens) == choice.text
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == MAX_TOKENS


def test_streamed_echo_sends_the_scored_prompt_in_the_first_chunk(
    tiny_client, model, offline, scored
) -> None:
    full = tiny_client.completions.create(model=model, **_args()).choices[0]
    chunks = list(
        tiny_client.completions.create(
            model=model, **_args(), stream=True, stream_options={"include_usage": True}
        )
    )
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert len(first.logprobs.tokens) == len(scored[0])
    _check_prompt_part(first.logprobs, offline, scored)

    tokens, token_logprobs, offsets = [], [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            token_logprobs += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    assert tokens == full.logprobs.tokens
    assert offsets == full.logprobs.text_offset
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=TOL)
    assert chunks[-1].usage.prompt_tokens == len(scored[0])
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_every_choice_of_n_gets_the_same_scored_prompt(tiny_client, model, offline, scored) -> None:
    r = tiny_client.completions.create(model=model, **_args(n=2, temperature=1.0, seed=3))
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        _check_prompt_part(choice.logprobs, offline, scored)
    assert r.usage.completion_tokens == 2 * MAX_TOKENS


def test_echo_alone_and_logprobs_alone_are_unchanged(tiny_client, model, scored) -> None:
    echoed = tiny_client.completions.create(model=model, **_args(logprobs=None))
    assert echoed.choices[0].logprobs is None
    assert echoed.choices[0].text.startswith(PROMPT)
    plain = tiny_client.completions.create(model=model, **_args(echo=False))
    assert len(plain.choices[0].logprobs.tokens) == MAX_TOKENS
    assert not plain.choices[0].text.startswith(PROMPT)


def test_out_of_range_logprobs_with_echo_is_a_400_naming_the_field(tiny_client, model) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        tiny_client.completions.create(model=model, **_args(logprobs=21))
    assert e.value.param == "logprobs"
    assert "must be in [0, 20]" in e.value.message

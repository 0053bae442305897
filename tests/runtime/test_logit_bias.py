"""logit_bias in the offline API: -100 bans a token, +100 forces one (greedy and sampled), a
biased request leaves its batch neighbours alone, and bad biases are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.request_limits import RequestError
from kvfleet.runtime.engine.sampling_params import SamplingParamsError

PROMPT = [101, 2025, 318, 257, 1332, 286, 262, 995]
FORCED = 1234  # an ordinary token (not EOS) the tiny model would not pick by itself


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)


def tokens(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_minus_100_bans_the_token_greedy_would_pick(llm: LLM) -> None:
    plain = tokens(llm, PROMPT, SamplingParams(temperature=0, max_tokens=6))
    banned = tokens(
        llm, PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias={plain[0]: -100})
    )
    assert banned[0] != plain[0]
    assert plain[0] not in banned


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_the_token_every_step(llm: LLM, temperature: float) -> None:
    assert FORCED not in tokens(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8))
    params = SamplingParams(
        temperature=temperature, seed=7, max_tokens=8, logit_bias={FORCED: 100}, logprobs=1
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == [FORCED] * 8
    # Logprobs are the model's own, before the bias: the forced token was not its favourite.
    assert out.logprobs is not None
    assert all(lp.logprob < lp.top[0][1] for lp in out.logprobs)


def test_biased_request_leaves_its_batch_neighbours_alone(llm: LLM) -> None:
    other = [7, 8, 9, 10, 11]
    plain = SamplingParams(temperature=0, max_tokens=10)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=10)
    biased = SamplingParams(temperature=0, max_tokens=10, logit_bias={FORCED: 100, 5: -100})
    alone = [tokens(llm, PROMPT, plain), tokens(llm, other, sampled)]
    batch = llm.generate([PROMPT, other, PROMPT], [plain, sampled, biased])
    assert [o.outputs[0].token_ids for o in batch[:2]] == alone
    assert batch[2].outputs[0].token_ids == [FORCED] * 10


def test_biases_of_several_requests_in_one_batch_go_to_their_own_rows(llm: LLM) -> None:
    a = SamplingParams(temperature=0, max_tokens=4, logit_bias={FORCED: 100})
    b = SamplingParams(temperature=0, max_tokens=4, logit_bias={FORCED + 1: 100, FORCED: -100})
    out = llm.generate([PROMPT, PROMPT], [a, b])
    assert out[0].outputs[0].token_ids == [FORCED] * 4
    assert out[1].outputs[0].token_ids == [FORCED + 1] * 4


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({5: 101}, ["101", "[-100, 100]"]),
        ({5: -100.5}, ["-100.5", "[-100, 100]"]),
        ({5: float("nan")}, ["nan"]),
        ({5: True}, ["True"]),
        ({"5": 1.0}, ["'5'", ">= 0"]),
        ({-1: 1.0}, ["-1", ">= 0"]),
        ({i: 1.0 for i in range(301)}, ["300", "301"]),
    ],
)
def test_bad_logit_bias_names_the_field_and_the_limit(bias: dict, words: list[str]) -> None:
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.field == "logit_bias"
    for w in words:
        assert w in str(e.value)


def test_300_entries_at_the_limits_are_accepted() -> None:
    bias = {i: (100 if i % 2 else -100) for i in range(300)}
    assert SamplingParams(logit_bias=bias).logit_bias == bias


def test_token_ids_past_the_vocabulary_are_refused_and_the_engine_goes_on(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestError) as e:
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 5}))
    assert e.value.field == "logit_bias" and str(vocab) in str(e.value)
    # min_tokens bans stop tokens by indexing the logits: an id past the vocabulary must be
    # refused up front, not crash the step.
    with pytest.raises(RequestError) as e:
        llm.generate([PROMPT], SamplingParams(min_tokens=2, stop_token_ids=[vocab]))
    assert e.value.field == "stop_token_ids" and str(vocab) in str(e.value)
    ok = SamplingParams(temperature=0, max_tokens=3, logit_bias={vocab - 1: 100})
    assert tokens(llm, PROMPT, ok) == [vocab - 1] * 3

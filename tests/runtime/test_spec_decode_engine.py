"""Speculative decoding through the engine: greedy output is exactly the output without it (with
preemption, chunked prefill and prefix hits in the batch), for prompt lookup and for a draft
model; at temperature 1 the tokens keep the model's distribution; vLLM's counters through a
served model's /metrics."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.sampling_params import SamplingParams
from server_fixtures import metric, running_server, scrape

TEXT = (
    "Kubernetes runs containers in pods. A Deployment keeps a number of pods running, and a "
    "Service gives them one address. The scheduler places each pod on a node with room for it."
)
SYSTEM = "You are a careful assistant. Answer in plain words and keep the user's wording. "


def _prompts() -> list[str]:
    """32 prompts: half ask to copy a text (drafts are accepted), half do not; most share a
    long prefix (prefix-cache hits); some are longer than the step budget (chunked)."""
    grounded = [
        f"{SYSTEM}Repeat this text exactly, then stop.\n\n{TEXT[: 60 + 9 * i]}\n\nRepeat:"
        for i in range(12)
    ]
    grounded += [f"Copy this list: {', '.join(str(n) for n in range(i, i + 30))}." for i in (3, 9)]
    grounded += [f"{SYSTEM}{TEXT} {TEXT}\nSay it again:", f"Quote: {TEXT}"]
    free = [f"{SYSTEM}Write a short poem about {w}." for w in ("rain", "ships", "tea", "maps")]
    free += [f"Question {i}: what is {i} plus {2 * i}?" for i in range(8)]
    free += ["Tell me a story.", "Name three colours.", "Why is the sky blue?", "Hello!"]
    return grounded + free


def _llm(spec: dict, kv_cache_memory: str = "40MiB") -> LLM:
    # Float32 weights (the bundled Q4 model dequantized), little KV memory (preemption), a
    # small step budget (chunked prefill).
    return LLM(
        "bundled", dtype="float32", quantization="none", kv_cache_memory=kv_cache_memory,
        max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16, speculative_config=spec,
    )  # fmt: skip


def _generate(llm: LLM, prompts: list[str], speculate: bool, params) -> list[list[int]]:
    """Tokens of each prompt, with speculation on or off in the same engine (off, it runs as
    an engine without any: no drafts are proposed)."""
    llm.engine.core.speculator.enabled = speculate
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def ngram_llm() -> Iterator[LLM]:
    # Suffixes from one token up: many proposals, many of them rejected.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4, "disable_by_batch_size": 64}  # fmt: skip
    with _llm(spec) as llm:
        yield llm


@pytest.fixture(scope="module")
def baseline(ngram_llm: LLM) -> list[list[int]]:
    return _generate(ngram_llm, _prompts(), False, GREEDY)


def test_ngram_greedy_output_is_exactly_the_output_without_speculation(
    ngram_llm: LLM, baseline: list[list[int]]
) -> None:
    core = ngram_llm.engine.core
    preempted, hits = core.scheduler.num_preemptions, core.kv.stats.hits
    assert core.speculator.counters.draft_tokens == 0  # off: nothing was proposed
    outs = _generate(ngram_llm, _prompts(), True, GREEDY)
    counters = core.speculator.counters
    assert core.scheduler.num_preemptions > preempted  # the batch saw preemption,
    assert core.kv.stats.hits > hits  # prefix hits,
    assert counters.accepted_tokens > 40  # and accepted drafts
    assert sum(counters.accepted_per_position) == counters.accepted_tokens
    assert counters.accepted_tokens < counters.draft_tokens  # and rejected ones
    assert core.kv.num_free_blocks == core.kv.num_blocks  # nothing leaked
    for i, (out, want) in enumerate(zip(outs, baseline, strict=True)):
        assert out == want, f"prompt {i}"


@pytest.fixture(scope="module")
def self_draft_llm() -> Iterator[LLM]:
    spec = {"model": "bundled", "num_speculative_tokens": 2, "disable_by_batch_size": 256}
    with _llm(spec, "80MiB") as llm:  # the draft's cache takes half: as many tokens as each
        yield llm


def test_draft_model_greedy_output_is_exactly_the_output_without_it(
    self_draft_llm: LLM, baseline: list[list[int]]
) -> None:
    # The model drafting for itself accepts nearly everything; a random draft almost nothing:
    # either way the tokens are the model's own.
    prompts, want = _prompts()[::4], baseline[::4]
    assert _generate(self_draft_llm, prompts, True, GREEDY) == want
    c = self_draft_llm.engine.core.speculator.counters
    assert c.accepted_tokens >= 0.8 * c.draft_tokens > 0
    assert not self_draft_llm.engine.core.speculator.draft.seqs  # shadows freed at the end
    with _llm({"model": "random:tiny", "num_speculative_tokens": 3}) as llm:
        assert _generate(llm, prompts[:3], True, GREEDY) == want[:3]
        assert llm.engine.core.speculator.counters.draft_tokens > 0


def _two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Statistic and degrees of freedom, cells with few samples pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    pooled = (na - sum(a[t] for t in cells), nb - sum(b[t] for t in cells))
    rows = [(a[t], b[t]) for t in cells] + ([pooled] if sum(pooled) else [])
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


def test_sampled_tokens_keep_the_models_distribution(self_draft_llm: LLM) -> None:
    prompt = "Once upon a time there was"
    params = [
        SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, ignore_eos=True)
        for s in range(120)
    ]
    counters = self_draft_llm.engine.core.speculator.counters
    before = (counters.draft_tokens, counters.accepted_tokens)
    draws = {on: _generate(self_draft_llm, [prompt] * len(params), on, params) for on in (0, 1)}
    drafted, accepted = counters.draft_tokens - before[0], counters.accepted_tokens - before[1]
    assert 0 < accepted < drafted  # both outcomes happened
    for position in (1, 2):  # the first token is sampled from the prompt, never drafted
        a = Counter(t[position] for t in draws[0])
        b = Counter(t[position] for t in draws[1])
        stat, df = _two_sample_chi_square(a, b)
        critical = df * (1 - 2 / (9 * df) + 4.26 * math.sqrt(2 / (9 * df))) ** 3  # p ≈ 1e-5
        assert stat < critical, (position, a, b)


def test_served_counters_show_the_acceptance_rate(tiny_llama_dir: Path, tmp_path: Path) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    with running_server(tiny_llama_dir, tmp_path, "--speculative-config", spec) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
        prompt = "one two three four " * 8
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=48,
                                          temperature=0)  # fmt: skip
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=model, prompt=prompt, max_tokens=48, temperature=0, stream=True
            )
        )
        assert streamed == whole.choices[0].text
        assert whole.usage.completion_tokens == 48
        samples = scrape(server)
    drafts = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [
        metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(3)
    ]
    assert metric(samples, "vllm:spec_decode_num_drafts_total") > 0
    assert 0 < accepted <= drafts and sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
    # One inter-token gap per step, as vLLM counts them: a verify step that keeps drafts
    # gives several tokens after one gap, not zero-second gaps between them.
    gaps = metric(samples, "vllm:inter_token_latency_seconds_count")
    assert 2 * 47 - accepted <= gaps < 2 * 47

"""Speculative decoding's parts without a model: prompt-lookup drafts, the configuration and its
flags, the sampler's rejection sampling (its token distribution is the model's exactly), and
the scheduler/KV cache under drafts (no block leaks, the prefix cache names accepted tokens
only)."""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime.engine.config import ConfigError
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager, hash_block, root_hash
from kvfleet.runtime.engine.ngram_proposer import propose_ngram
from kvfleet.runtime.engine.request import Request, RequestStatus
from kvfleet.runtime.engine.sampler import Sampler
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.runtime.engine.speculative_config import SpeculativeConfig
from kvfleet.runtime.engine.speculator import Speculator

# --- prompt lookup ----------------------------------------------------------------------------


def test_ngram_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 2, 3]
    # "2 3" last occurred at 6..7, followed by 7 7 5; "5 2 3" never occurred before.
    assert propose_ngram(tokens, 3, 1, 3) == [7, 7, 5]
    # A 3-token suffix that recurs wins over the 2-token one.
    tokens = [4, 2, 3, 8, 8, 1, 2, 3, 6, 4, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [8, 8]
    assert propose_ngram(tokens, 2, 1, 2) == [6, 4]


def test_ngram_proposes_nothing_without_a_recurring_suffix_and_stops_at_the_end() -> None:
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []
    assert propose_ngram([5, 6, 5], 4, 1, 2) == [6, 5]  # only what follows exists
    assert propose_ngram([5, 6, 6], 4, 2, 2) == []  # min_n 2: the 1-token match is not used
    assert propose_ngram([7], 4, 1, 4) == []


# --- configuration ----------------------------------------------------------------------------


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv))).speculative_config


def test_speculative_config_json_and_the_older_flags_mean_the_same() -> None:
    new = _config(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}',
    )
    old = _config(
        "--speculative-model", "[ngram]", "--num-speculative-tokens", "3",
        "--ngram-prompt-lookup-max", "5",
    )  # fmt: skip
    assert new == old == SpeculativeConfig("ngram", 3, prompt_lookup_max=5, prompt_lookup_min=5)
    # vLLM's defaults: one bound not given is the other; neither, both 5.
    assert (new.prompt_lookup_min, new.prompt_lookup_max) == (5, 5)
    lo_only = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (lo_only.prompt_lookup_min, lo_only.prompt_lookup_max) == (2, 2)
    plain = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (plain.prompt_lookup_min, plain.prompt_lookup_max) == (5, 5)
    draft = _config("--speculative-config", '{"model": "bundled", "num_speculative_tokens": 2}')
    assert (draft.method, draft.model) == ("draft_model", "bundled")
    assert _config() is None


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--speculative-config", "{not json"], "not valid JSON"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens: required"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}'],
            "num_speculative_tokens: must be an integer in [1, 16], got 40",
        ),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "method: must be one of ngram, draft_model, got 'eagle'",
        ),
        (
            ["--speculative-config", '{"num_speculative_tokens": 2, "draft_tp": 2}'],
            "unsupported key(s) draft_tp",
        ),
        (
            ["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'],
            "needs a draft model",
        ),
        (
            [
                "--num-speculative-tokens",
                "2",
                "--ngram-prompt-lookup-min",
                "3",
                "--ngram-prompt-lookup-max",
                "2",
            ],
            "need 1 <= min <= max <= 32",
        ),
        (
            [
                "--speculative-model",
                "bundled",
                "--num-speculative-tokens",
                "2",
                "--tensor-parallel-size",
                "2",
            ],
            "a draft model runs without tensor parallelism",
        ),
    ],
)
def test_bad_speculative_settings_are_refused_naming_the_key(argv: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(*argv)
    assert names in str(err.value)


# --- the sampler's rejection sampling ---------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _rows(n: int, **params) -> list[Request]:
    p = SamplingParams(max_tokens=4, **params)
    # Distinct indexes: seeded rows draw from seed + index, as n completions of one request do.
    return [Request(f"r{i}", [1], p, frozenset(), 4, index=i) for i in range(n)]


def _chi_square_critical(df: int, z: float = 4.26) -> float:
    """The chi-square quantile at the normal quantile z (Wilson-Hilferty): 4.26 ≈ 1e-5."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _assert_distribution(tokens: list[int], probs: torch.Tensor) -> None:
    counts = Counter(tokens)
    n = len(tokens)
    support = [t for t in range(probs.numel()) if probs[t] > 0]
    assert set(counts) <= set(support), f"tokens outside the distribution: {counts}"
    stat = sum((counts[t] - n * probs[t].item()) ** 2 / (n * probs[t].item()) for t in support)
    assert stat < _chi_square_critical(len(support) - 1), (counts, probs.tolist())


@pytest.mark.parametrize(
    ("draft", "params"),
    [
        (0, {"temperature": 1.0}),  # the likeliest token
        (3, {"temperature": 1.0}),  # an unlikely one
        (1, {"temperature": 0.7, "top_k": 3}),
        (4, {"temperature": 1.0, "top_k": 3}),  # outside top-k: p(d) = 0, always rejected
        (2, {"temperature": 1.3, "top_p": 0.8, "seed": 11}),  # seeded rows' own generators
    ],
)
def test_verified_tokens_follow_the_models_distribution_exactly(draft: int, params) -> None:
    n = 20000
    rows = _rows(n, **params)
    logits = LOGITS.repeat(n, 1)
    sampler = Sampler(seed=3)
    tokens, _ = sampler(logits, rows, drafts=[draft] * n)
    expected = sampler._probs(LOGITS[None], rows[:1])[0]
    _assert_distribution(tokens, expected / expected.sum())
    # A draft is kept exactly as often as the model would pick it.
    kept = tokens.count(draft) / n
    p = (expected[draft] / expected.sum()).item()
    assert abs(kept - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_greedy_rows_keep_a_draft_only_when_it_is_the_argmax() -> None:
    rows = _rows(3, temperature=0.0)
    tokens, _ = Sampler()(LOGITS.repeat(3, 1), rows, drafts=[0, 2, -1])
    assert tokens == [0, 0, 0]


# --- the scheduler and KV cache under drafts ------------------------------------------------


def _chain(tokens: list[int], block_size: int, blocks: int) -> list[bytes]:
    hashes, parent = [], root_hash(0)
    for i in range(blocks):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4, 8]),
    num_blocks=st.integers(6, 30),
    budget=st.integers(4, 40),
    seed=st.integers(0, 10_000),
    prompts=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=12), min_size=1, max_size=6),
)
def test_drafts_never_leak_blocks_and_the_prefix_cache_names_accepted_tokens_only(
    block_size: int, num_blocks: int, budget: int, seed: int, prompts: list[list[int]]
) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, True)
    sched = Scheduler(SchedulerConfig(4, budget, True), kv)
    cap = num_blocks * block_size - 8  # each request fits the pool alone, drafts included
    reqs = [
        Request(f"r{i}", p[:cap], SamplingParams(max_tokens=8), frozenset(), 8)
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        sched.add(r)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        for r in sched.running:  # what the speculator would do after a step
            decoding = r.num_computed_tokens == r.num_tokens - 1
            r.spec_token_ids = [rng.randint(1, 4) for _ in range(rng.randint(0, 4))] * decoding
        batch = sched.schedule()
        for r, n in zip(batch.requests, batch.num_tokens, strict=True):
            assert len(kv.blocks_of(r.request_id)) * block_size >= r.num_computed_tokens + n
            r.num_computed_tokens += n
            if r.num_computed_tokens < r.num_tokens:
                continue  # a prompt chunk
            drafts = r.spec_token_ids[: n - 1]
            accepted = rng.randint(0, len(drafts))
            r.num_computed_tokens -= len(drafts) - accepted
            r.all_token_ids.extend([*drafts[:accepted], rng.randint(1, 4)])
            if r.num_output_tokens >= r.max_tokens:
                sched.finish(r, "length")
            else:
                kv.trim(r, r.num_tokens)
        # Every named block of a live request is the hash chain of its own tokens.
        for rid, blocks in kv.req_blocks.items():
            r = sched.requests[rid]
            named = [b for b in blocks if kv.block_hash[b] is not None]
            assert len(named) * block_size <= r.num_tokens
            chain = _chain(r.all_token_ids, block_size, len(named))
            assert [kv.block_hash[b] for b in blocks[: len(named)]] == chain
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == num_blocks and all(c == 0 for c in kv.ref_counts)


# --- how many drafts a step may carry -------------------------------------------------------


def _decoding(rid: str) -> Request:
    r = Request(rid, [5, 6, 7] * 4 + [5, 6], SamplingParams(max_tokens=64), frozenset(), 64)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_drafts_stay_within_the_rows_a_step_may_take() -> None:
    config = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, disable_by_batch_size=8)
    one, two = [_decoding("a")], [_decoding("b"), _decoding("c")]
    Speculator(config, max_rows=8).propose(one, 512)
    assert one[0].spec_token_ids == [7, 5, 6]  # 1 + 3 rows fit in 8
    Speculator(config, max_rows=6).propose(two, 512)
    assert [r.spec_token_ids for r in two] == [[7, 5], [7, 5]]  # 2 + 2 x 2 rows
    many = [_decoding(f"r{i}") for i in range(8)]
    Speculator(config, max_rows=8).propose(many, 512)
    assert all(not r.spec_token_ids for r in many)  # no room: plain decodes
    Speculator(config).propose(many, 512)  # no limit
    assert all(len(r.spec_token_ids) == 3 for r in many)
    too_many = [*many, _decoding("x")]  # above disable_by_batch_size
    Speculator(config).propose(too_many, 512)
    assert all(not r.spec_token_ids for r in too_many)


def test_a_verify_step_runs_as_one_call_from_token_ids_to_logits(
    tiny_llama_dir, one_calls: list[int]
) -> None:
    """On CPU a step whose sequence carries drafts is a decode step of one row per token: it
    takes the one-call path (the fused stack and LM head in C) like any decode step."""
    from kvfleet.kernels.cpu import cpu_library
    from kvfleet.runtime.engine.llm import LLM

    if not cpu_library.available():
        pytest.skip("the CPU kernels are not built here")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(str(tiny_llama_dir), dtype="float32", speculative_config=spec) as llm:
        llm.generate([[5, 6, 7] * 6], SamplingParams(temperature=0, max_tokens=12))
        drafted = llm.engine.core.speculator.counters.draft_tokens
    assert drafted > 0 and any(rows > 1 for rows in one_calls), one_calls


def test_a_verify_step_is_timed_as_decode_rows_not_prompt_tokens(tiny_llama_dir, monkeypatch):
    """The step-time model that bounds a step's prompt share (--max-step-time-ratio) learns a
    verify step as a decode step of 1 + drafts rows: counted as prompt tokens, its drafts
    would teach the model that prompt tokens cost what decode rows do."""
    from kvfleet.runtime.engine.llm import LLM
    from kvfleet.runtime.engine.step_time import StepTimeModel

    seen: list[tuple[int, int]] = []
    observe = StepTimeModel.observe

    def recording(self, prompt_tokens: int, decode_rows: int, seconds: float, context: int) -> None:
        seen.append((prompt_tokens, decode_rows))
        observe(self, prompt_tokens, decode_rows, seconds, context)

    monkeypatch.setattr(StepTimeModel, "observe", recording)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with LLM(
        str(tiny_llama_dir), dtype="float32", speculative_config=spec, max_step_time_ratio=4.0
    ) as llm:
        llm.generate([[5, 6, 7] * 6], SamplingParams(temperature=0, max_tokens=12))
        assert llm.engine.core.speculator.counters.draft_tokens > 0
    assert seen[0] == (18, 0)  # the prompt
    assert any(rows > 1 for _, rows in seen[1:]), seen  # verify steps, as decode rows
    assert all(prompt == 0 for prompt, _ in seen[1:]), seen


def test_a_draft_model_catches_up_a_long_prompt_in_step_sized_chunks(tiny_llama_dir, monkeypatch):
    """A draft model's first pass over a prompt longer than the step budget runs in chunks of
    at most max_num_batched_tokens, one per step, the sequence drafting once it has caught up:
    one draft forward over the whole prompt would stall every running stream for it."""
    from kvfleet.runtime.engine.draft_proposer import DraftProposer
    from kvfleet.runtime.engine.llm import LLM

    sizes: list[int] = []
    run = DraftProposer._run

    def recording(self, batch) -> None:
        sizes.append(batch.total_tokens)
        run(self, batch)

    monkeypatch.setattr(DraftProposer, "_run", recording)
    prompt = [5 + (i * 7919) % 4000 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=24)
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    kwargs = {"dtype": "float32", "max_num_batched_tokens": 64}
    with LLM(str(tiny_llama_dir), **kwargs) as plain:
        expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    with LLM(str(tiny_llama_dir), speculative_config=spec, **kwargs) as llm:
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        accepted = llm.engine.core.speculator.counters.accepted_tokens
    assert got == expected
    assert accepted > 0  # the model is its own draft: it drafts once caught up
    assert max(sizes) <= 64, sizes
    assert sum(size for size in sizes if size > 8) >= len(prompt) - 64, sizes

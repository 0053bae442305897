"""Async scheduling (--async-scheduling): each step is launched before the tokens of the step
before are read, and every request still gets exactly the tokens, logprobs and finish reasons a
synchronous engine gives it — with stops that land while a step is in flight, max_tokens 1,
preemption, chunked prefill, prefix hits, n > 1, seeds, penalties, grammars and aborts — and
every block comes back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.runtime import LLM, SamplingParams, StructuredOutputsParams
from kvfleet.runtime.engine.async_step import PLACEHOLDER, AsyncSteps
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.engine_args import add_engine_args, engine_config_from_args
from server_fixtures import running_server

SYSTEM = "You are a helpful assistant who answers briefly and to the point. " * 3


def _prompts() -> list[str]:
    """Short and long prompts (longer than the step budget: chunked), most behind one shared
    prefix (prefix-cache hits)."""
    prompts = [f"{SYSTEM}Question {i}: name {i} things that are blue." for i in range(10)]
    prompts += [f"Count from {i}: " + ", ".join(str(k) for k in range(i, i + 25)) for i in (1, 7)]
    prompts += ["Hi", "Tell me a story about a ship.", "1, 2, 3,", "The sky is"]
    return prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    # 320 tokens of KV cache for up to 8 sequences of up to ~200 tokens (preemption), and a
    # step budget of 64 tokens (chunked prefill).
    return LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory=320 * 512,
        max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=True,
    )  # fmt: skip


def _run(llm: LLM, prompts, params, in_flight: bool) -> list[list[tuple]]:
    """Each prompt's completions as (token ids, finish reason, stop reason, logprobs), run with
    async scheduling on or off in the same engine; every block is free afterwards."""
    core = llm.engine.core
    core.pipeline = AsyncSteps(core) if in_flight else None
    outs = llm.generate(prompts, params)
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.has_unfinished()
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs
    ]


def _both(llm: LLM, prompts, params) -> list[list[tuple]]:
    """The sync run's completions, after checking the async run's against them: the same
    tokens and reasons, and logprobs equal but for float rounding (a batch of other rows
    rounds a row's logits differently)."""
    sync = _run(llm, prompts, params, in_flight=False)
    pipelined = _run(llm, prompts, params, in_flight=True)
    assert [[c[:3] for c in o] for o in pipelined] == [[c[:3] for c in o] for o in sync]
    for o, p in zip(sync, pipelined, strict=True):
        for c, d in zip(o, p, strict=True):
            for a, b in zip(c[3] or [], d[3] or [], strict=True):
                assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    return sync


def test_greedy_tokens_are_those_of_a_synchronous_engine(llm):
    prompts = _prompts()
    lengths = [1, 2, 5, 40] * 4
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    preempted = llm.engine.core.scheduler.num_preemptions
    plain = _both(llm, prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > preempted  # the cache ran out
    assert [len(o[0][0]) for o in plain] == lengths
    assert all(o[0][1] == "length" for o in plain)
    # Stop on each long completion's 4th token: the stop is read while the next step runs.
    stops = [
        SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[o[0][0][3]] if n > 5 else [])
        for n, o in zip(lengths, plain, strict=True)
    ]
    stopped = _both(llm, prompts, stops)
    for n, o in zip(lengths, stopped, strict=True):
        if n > 5:
            ids, reason, stop_reason, _ = o[0]
            assert (reason, stop_reason) == ("stop", ids[-1])
            assert len(ids) <= 4


def test_a_request_at_its_length_is_not_run_again(llm):
    """Its last token in flight, it is not scheduled once more: as many forward passes as a
    synchronous engine runs."""
    core = llm.engine.core
    passes = []
    for in_flight in (False, True):
        before = core.counters.steps
        _run(llm, ["The sky is"], SamplingParams(temperature=0, max_tokens=9), in_flight)
        passes.append(core.counters.steps - before)
    assert passes[0] == passes[1] == 9


def test_a_request_at_its_length_gives_its_seat_up_at_once(tiny_llama_dir):
    """One sequence at a time: the next is admitted in the call that launches the last
    token's step, so the async engine needs one call more than the synchronous one (to read
    that token), not one more per request."""
    calls = []
    for in_flight in (False, True):
        llm = LLM(
            str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory="8MiB",
            max_num_seqs=1, async_scheduling=in_flight,
        )  # fmt: skip
        engine = llm.engine
        for i in range(3):
            engine.add_request(
                f"r{i}", f"Prompt {i}", SamplingParams(max_tokens=4, ignore_eos=True)
            )
        n = 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        calls.append(n)
    assert calls == [12, 13]


def test_generated_blocks_serve_a_later_prompt_as_they_do_synchronously(llm):
    """A block a placeholder completes is named once its token is known, not with the
    placeholder: a conversation's next turn hits the cache as far as it does without."""
    first = f"{SYSTEM}Tell me about ships."
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    core = llm.engine.core
    cached = []
    for in_flight in (False, True):
        core.pipeline = AsyncSteps(core) if in_flight else None
        core.kv.reset_prefix_cache()
        (out,) = llm.generate(first, params)
        turn = out.prompt_token_ids + out.outputs[0].token_ids + [13]
        (again,) = llm.generate([turn], SamplingParams(temperature=0, max_tokens=1))
        cached.append(again.num_cached_tokens)
    assert cached[0] == cached[1] >= 96


def test_seeded_sampling_penalties_and_logprobs_match(llm):
    params = SamplingParams(
        n=2, temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=24, logprobs=3,
        repetition_penalty=1.3, presence_penalty=0.5, logit_bias={13: 2.0}, min_tokens=4,
    )  # fmt: skip
    outs = _both(llm, _prompts()[:8], params)
    assert all(len(c[3]) == len(c[0]) for o in outs for c in o)  # a logprob entry per token


def test_a_grammar_holds_and_its_tokens_match(llm):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=schema),
    )  # fmt: skip
    llm.engine.core.pipeline = AsyncSteps(llm.engine.core)
    for out in llm.generate(_prompts()[:4], params):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    _both(llm, _prompts()[:4], params)


def test_an_abort_while_its_token_is_in_flight_frees_its_blocks(llm):
    engine, core = llm.engine, llm.engine.core
    core.pipeline = AsyncSteps(core)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(_prompts()[:4]):
        engine.add_request(f"r{i}", prompt, greedy)
    while not any(r.pending_row >= 0 for r in core.scheduler.running if r.num_output_tokens > 3):
        engine.step()
    victim = next(r for r in core.scheduler.running if r.pending_row >= 0)
    assert victim.all_token_ids[-1] == PLACEHOLDER
    assert engine.abort_request(victim.group_id) and victim.finished
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert victim.group_id not in done
    assert core.kv.num_free_blocks == core.kv.num_blocks
    expected = _run(llm, _prompts()[:4], greedy, in_flight=False)
    for rid, ids in done.items():
        assert ids == expected[int(rid[1:])][0][0]


class _FaultySampler:
    """The engine's sampler, raising for any batch that holds a request with stop string
    FAULT (which the tiny model never writes)."""

    FAULT = "\x00sampler fault\x00"

    def __init__(self, real) -> None:
        self.real = real

    def sample(self, logits, requests, argmax=None, drafts=None):
        if any(self.FAULT in r.params.stop for r in requests):
            raise RuntimeError("injected sampler fault")
        return self.real.sample(logits, requests, argmax, drafts)

    def __call__(self, logits, requests, argmax=None, drafts=None):
        tokens, logprobs = self.sample(logits, requests, argmax, drafts)
        return (tokens if isinstance(tokens, list) else tokens.tolist()), logprobs


def test_a_sampling_fault_fails_that_request_only(llm, monkeypatch):
    core = llm.engine.core
    prompts = _prompts()[:3]
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[_FaultySampler.FAULT], n=2
    )
    alone = _run(llm, prompts[::2], good, in_flight=False)
    monkeypatch.setattr(core, "sampler", _FaultySampler(core.sampler))
    core.pipeline = AsyncSteps(core)
    outs = llm.generate(prompts, [good, bad, good])
    got = [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]
    assert got == [o[0][0] for o in alone]
    assert "injected sampler fault" in outs[1].error
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.has_unfinished()


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(1, 150), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=10,
    )
)
def test_any_workload_gets_the_synchronous_tokens_and_leaks_no_block(llm, workload):
    """Prompts of 1-150 tokens (ids in a pattern of their own), 1-12 tokens each, some
    stopping on any of 900 token ids (about one in five of those stops early)."""
    vocab = llm.engine.core.model_config.vocab_size
    prompts = [
        [(7 * i + 11 * k + 3) % vocab for i in range(n)] for k, (n, _, _) in enumerate(workload)
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=m,
            stop_token_ids=list(range(s * 1000, s * 1000 + 900)) if s else [],
        )
        for _, m, s in workload
    ]
    _both(llm, prompts, params)
    for r in llm.engine.core.scheduler.requests.values():
        assert PLACEHOLDER not in r.all_token_ids


def test_the_flag_refuses_what_needs_each_steps_tokens_on_the_host():
    with pytest.raises(ConfigError, match=r"async_scheduling: not with speculative_config"):
        EngineConfig(
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )
    with pytest.raises(ConfigError, match=r"async_scheduling: not with tensor_parallel_size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_args(parser, serving=True)
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not engine_config_from_args(parser.parse_args([])).async_scheduling


def test_a_served_engine_streams_the_synchronous_text(llm, tiny_llama_dir, tmp_path):
    prompts = ["Once upon a time", f"{SYSTEM}Say hello."]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.engine.core.pipeline = None
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    with running_server(tiny_llama_dir, tmp_path, "--async-scheduling") as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="x")
        model = client.models.list().data[0].id
        for prompt, text in zip(prompts, expected, strict=True):
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert "".join(c.choices[0].text for c in stream) == text

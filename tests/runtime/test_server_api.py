"""`kvfleet serve` through the official openai tiny_client: completions and chat, streaming and not,
n > 1, stop, logprobs, seeds, usage, 64 concurrent streams against the offline API, /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from server_fixtures import (
    metric,
    open_stream,
    read_events,
    scrape,
    wait_for_metric,
)

from kvfleet import contract


@pytest.fixture(scope="module")
def model(tiny_client: openai.OpenAI, tiny_llama_dir: Path) -> str:
    models = tiny_client.models.list().data
    assert [m.id for m in models] == [tiny_llama_dir.name]
    return models[0].id


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path):
    from kvfleet.runtime import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB")


def test_completion_matches_the_offline_api_and_counts_usage(tiny_client, model, offline):
    from kvfleet.runtime import SamplingParams

    r = tiny_client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    want = offline.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12)
    )
    assert r.choices[0].text == want[0].outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_token_id_prompts_and_prompt_lists_give_one_choice_each(tiny_client, model, offline):
    ids = offline.tokenizer.encode("Once upon a time", add_special_tokens=False)
    by_text = tiny_client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    by_ids = tiny_client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = tiny_client.completions.create(
        model=model, prompt=["Once upon a time", "Hello"], max_tokens=5, temperature=0, n=2
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    first = [c.text for c in many.choices if c.index in (0, 1)]
    assert first[0] == first[1]  # greedy: the same completion twice
    assert by_text.choices[0].text.startswith(first[0])
    assert many.usage.prompt_tokens == len(ids) + len(offline.tokenizer.encode("Hello"))
    assert many.usage.completion_tokens == 4 * 5


def test_echo_prepends_the_prompt(tiny_client, model):
    r = tiny_client.completions.create(
        model=model, prompt="Echo me", max_tokens=3, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith("Echo me")
    assert len(r.choices[0].text) > len("Echo me")


def test_streamed_completion_equals_the_unstreamed_one(tiny_client, model):
    args = {"model": model, "prompt": "Stream this", "max_tokens": 10, "temperature": 0}
    full = tiny_client.completions.create(**args)
    chunks = list(
        tiny_client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_continuous_usage_counts_every_token_where_it_arrives(tiny_client, model):
    """vLLM's stream_options.continuous_usage_stats: each chunk says how many tokens so far,
    so a client counts tokens (a chunk may carry several, or none that decode to text)."""
    args = {"model": model, "prompt": "Count with me", "max_tokens": 12, "temperature": 0}
    args["extra_body"] = {"ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(tiny_client.completions.create(**args, stream=True, stream_options=options))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == tiny_client.completions.create(**args).choices[0].text
    chat = tiny_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
        stream_options=options,
        extra_body={"ignore_eos": True},
    )
    assert [c.usage.completion_tokens for c in chat][-1] == 5


def test_stop_string_cuts_the_text_before_it(tiny_client, model):
    args = {"model": model, "prompt": "Tell me a story", "max_tokens": 16, "temperature": 0}
    full = tiny_client.completions.create(**args).choices[0].text
    stop = full[6:10]
    want = full[: full.find(stop)]
    r = tiny_client.completions.create(**args, stop=[stop])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    streamed = list(tiny_client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output keeps the matched stop string, streaming or not.
    keep = {"stop": [stop], "extra_body": {"include_stop_str_in_output": True}}
    assert tiny_client.completions.create(**args, **keep).choices[0].text == want + stop
    streamed = list(tiny_client.completions.create(**args, **keep, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want + stop


def test_seed_makes_sampling_repeatable(tiny_client, model):
    args = {"model": model, "prompt": "Random words:", "max_tokens": 12, "temperature": 1.0}
    a = tiny_client.completions.create(**args, seed=1234).choices[0].text
    b = tiny_client.completions.create(**args, seed=1234).choices[0].text
    c = tiny_client.completions.create(**args, seed=4321).choices[0].text
    assert a == b
    assert a != c


def test_n_completions_are_independent_samples(tiny_client, model):
    r = tiny_client.completions.create(
        model=model, prompt="Pick:", max_tokens=8, temperature=1.0, n=3, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 24


def test_completion_logprobs(tiny_client, model):
    r = tiny_client.completions.create(
        model=model, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best


def test_chat_matches_the_offline_chat(tiny_client, model, offline):
    from kvfleet.runtime import SamplingParams

    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    r = tiny_client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=9, temperature=0
    )
    plain = [messages[0], {"role": "user", "content": "Hi there"}]
    want = offline.chat(plain, SamplingParams(temperature=0, max_tokens=9))[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streamed_chat_sends_role_first_finish_last_and_usage(tiny_client, model):
    args = {
        "model": model,
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 7,
        "temperature": 0,
        "n": 2,
    }
    full = tiny_client.chat.completions.create(**args)
    chunks = list(
        tiny_client.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
    )
    for k in range(2):
        mine = [ch for c in chunks if c.choices for ch in c.choices if ch.index == k]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason == full.choices[k].finish_reason
        assert all(ch.finish_reason is None for ch in mine[:-1])
        assert "".join(ch.delta.content or "" for ch in mine) == full.choices[k].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_logprobs(tiny_client, model):
    r = tiny_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert 1 <= len(c.top_logprobs) <= 2
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(c.bytes).decode() == c.token


async def test_64_concurrent_streams_equal_the_offline_api(tiny_server, model, offline):
    from kvfleet.runtime import SamplingParams

    prompts = [f"Request number {i} says" for i in range(64)]
    lengths = [4 + i % 13 for i in range(64)]
    want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    async_client = openai.AsyncOpenAI(
        base_url=tiny_server.api_url, api_key="unused", max_retries=0, timeout=120
    )

    async def one(prompt: str, n: int) -> str:
        stream = await async_client.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    got = await asyncio.wait_for(asyncio.gather(*map(one, prompts, lengths)), 150)
    await async_client.close()
    assert got == [w.outputs[0].text for w in want]


def test_metrics_are_pinned_and_token_counters_match_usage(tiny_server, tiny_client, model):
    before = scrape(tiny_server)
    names = {n for n, _ in before}
    # The LoRA series exist only under --enable-lora (test_lora_server.py reads them there),
    # the speculative ones only under --speculative-config (test_spec_decode_engine.py).
    only_when_on = {*contract.LORA_GAUGES, *(f"{c}_total" for c in contract.SPEC_DECODE_COUNTERS)}
    assert contract.exposed_names() - only_when_on <= names
    assert not names & only_when_on
    assert all(
        dict(labels).get("model_name") == model for n, labels in before if n.startswith("vllm:")
    )
    r = tiny_client.completions.create(
        model=model, prompt=["Count the tokens", "Twice"], max_tokens=9, temperature=0.5, n=2
    )
    after = scrape(tiny_server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == 4 * 8
    assert delta("vllm:prefix_cache_queries_total") >= r.usage.prompt_tokens
    # Request-level histograms: one observation per finished request, sums matching usage.
    assert delta("vllm:request_prompt_tokens_count") == 4
    assert delta("vllm:request_prompt_tokens_sum") == 2 * r.usage.prompt_tokens  # n=2
    assert delta("vllm:request_generation_tokens_sum") == r.usage.completion_tokens
    assert delta("vllm:request_generation_tokens_bucket", le="10.0") == 4  # 9 tokens each
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 0
    for name in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{name}_time_seconds_count") == 4
    assert delta("vllm:request_decode_time_seconds_sum") < delta(
        "vllm:request_inference_time_seconds_sum"
    )


def test_disconnect_mid_stream_frees_the_kv_cache(tiny_server, model):
    body = {
        "model": model,
        "prompt": "Go on forever",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    conn, resp = open_stream(tiny_server.port, "/v1/completions", body, timeout=30)
    # A few tokens in: the request is running and holds KV blocks.
    assert len(read_events(resp, 3)) == 3, "the stream ended before the client hung up"
    assert metric(scrape(tiny_server), contract.KV_CACHE_USAGE_PERC) > 0
    assert metric(scrape(tiny_server), contract.NUM_REQUESTS_RUNNING) == 1
    conn.sock.close()  # hang up mid-stream
    conn.close()
    wait_for_metric(tiny_server, contract.KV_CACHE_USAGE_PERC, lambda v: v == 0)
    wait_for_metric(tiny_server, contract.NUM_REQUESTS_RUNNING, lambda v: v == 0)
    samples = scrape(tiny_server)
    assert metric(samples, "vllm:request_success_total", finished_reason="abort") >= 1


async def test_bench_serve_drives_the_server_and_counts_every_token(tiny_server, offline):
    from kvfleet.runtime.bench.serve_client import drive

    ids = offline.tokenizer.encode("Benchmark prompt", add_special_tokens=False)
    workload = [(ids, 5 + i) for i in range(6)]
    result = await drive(tiny_server.url, workload, concurrency=3, timeout=60)
    assert result.errors == 0 and result.num_requests == 6
    assert result.output_tokens_per_s * result.duration_s == pytest.approx(sum(range(5, 11)))
    assert 0 < result.ttft_p50 <= result.e2e_p50 and 0 < result.itl_p50 <= result.itl_p99


async def test_bench_serve_keeps_samples_out_of_the_json_and_plots_them(
    tiny_server, offline, tmp_path
):
    from kvfleet.runtime.bench.plots import plot_concurrency_sweep, plot_latency_cdfs
    from kvfleet.runtime.bench.serve_client import drive

    ids = offline.tokenizer.encode("Plot prompt", add_special_tokens=False)
    runs = [await drive(tiny_server.url, [(ids, 4)] * 4, concurrency=c, timeout=60) for c in (1, 4)]
    assert len(runs[0].samples["ttft"]) == 4 and len(runs[0].samples["e2e"]) == 4
    assert 0 < len(runs[0].samples["itl"]) <= 4 * 3
    assert "samples" not in runs[0].public() and runs[0].public()["concurrency"] == 1
    plot_latency_cdfs({"concurrency 1": runs[0], "concurrency 4": runs[1]}, tmp_path / "cdf.png")
    plot_concurrency_sweep(runs, tmp_path / "sweep.png")
    assert (tmp_path / "cdf.png").stat().st_size > 10_000
    assert (tmp_path / "sweep.png").stat().st_size > 10_000

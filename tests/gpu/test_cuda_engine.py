"""The engine on a CUDA GPU: decode steps replayed from CUDA graphs give the eager path's greedy
tokens (with preemption, chunked prefill and prefix hits too), and every sampling option runs on
the device. Skipped where torch sees no GPU (CI has none); on a lent GPU run `pytest tests/gpu`.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "random:llama-1b"


def _greedy(eager: bool, prompts: list[str], max_tokens: int, **engine) -> tuple[list, int]:
    from kvfleet.runtime import LLM, SamplingParams

    llm = LLM(model=MODEL, device="cuda", dtype="float32", enforce_eager=eager, **engine)
    try:
        assert (llm.engine.runner.graphs is None) == eager
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.scheduler.num_preemptions
    finally:
        del llm
        gc.collect()  # the next engine sizes its KV cache from the memory free then
        torch.cuda.empty_cache()


def test_graph_decode_gives_the_eager_greedy_tokens():
    prompts = ["The capital of France is", "Hello", "Once upon a time there was", "1 2 3 4 5"] * 5
    want, _ = _greedy(True, prompts, 24, max_model_len=4096)
    got, _ = _greedy(False, prompts, 24, max_model_len=4096)
    assert got == want


def test_graph_decode_under_preemption_chunking_and_prefix_hits():
    base = "You are a helpful assistant. " * 20
    prompts = [base + f"Question {i}: what is {i} plus {i}?" for i in range(24)] + ["Hi"] * 4
    engine = dict(max_model_len=1024, kv_cache_memory="96MiB", max_num_batched_tokens=256)
    want, preempted = _greedy(True, prompts, 48, **engine)
    got, _ = _greedy(False, prompts, 48, **engine)
    assert preempted > 0  # the cache is small enough to force it
    assert got == want


def test_every_sampling_option_runs_on_the_gpu_and_seeds_reproduce():
    from kvfleet.runtime import LLM, SamplingParams

    llm = LLM(model=MODEL, device="cuda", dtype="bfloat16", max_model_len=1024)
    prompts = ["The capital of France is", "Write a haiku about GPUs", "1 2 3"]
    cases = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=7),
        SamplingParams(max_tokens=16, top_k=50, top_p=0.9, min_p=0.05, seed=11),
        SamplingParams(
            max_tokens=16,
            temperature=0.7,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={5: 5.0},
            seed=3,
        ),
        SamplingParams(max_tokens=8, temperature=0.9, n=2, logprobs=5, prompt_logprobs=2, seed=5),
        SamplingParams(max_tokens=8, min_tokens=4, temperature=0.5, seed=1),
    ]
    for params in cases:
        first, again = llm.generate(prompts, params), llm.generate(prompts, params)
        tokens = [[list(c.token_ids) for c in o.outputs] for o in first]
        assert tokens == [[list(c.token_ids) for c in o.outputs] for o in again]
        for o in first:
            for c in o.outputs:
                assert c.finish_reason in ("length", "stop")  # never "error"
                assert params.min_tokens <= len(c.token_ids) <= params.max_tokens
                if params.logprobs:
                    assert len(c.logprobs) == len(c.token_ids)

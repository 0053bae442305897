"""Async scheduling on a CUDA GPU: the greedy tokens of a synchronous engine (CUDA graphs and
eager, with preemption, chunked prefill and prefix hits), and no host synchronization while a
decode step is launched and sampled, which is what lets the host's work overlap the device's.
Skipped where torch sees no GPU (CI has none); on a lent GPU run `pytest tests/gpu`."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "random:llama-1b"
BASE = "You are a helpful assistant. " * 20
PROMPTS = [BASE + f"Question {i}: what is {i} plus {i}?" for i in range(24)] + ["Hi"] * 4


def _engine(eager: bool):
    from kvfleet.runtime import LLM

    return LLM(
        model=MODEL, device="cuda", dtype="float32", enforce_eager=eager, max_model_len=1024,
        kv_cache_memory="96MiB", max_num_batched_tokens=256, async_scheduling=True,
    )  # fmt: skip


def _release(llm) -> None:
    del llm
    gc.collect()  # the next engine sizes its KV cache from the memory free then
    torch.cuda.empty_cache()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_async_steps_give_the_synchronous_greedy_tokens(eager):
    from kvfleet.runtime import SamplingParams
    from kvfleet.runtime.engine.async_step import AsyncSteps

    llm = _engine(eager)
    try:
        core = llm.engine.core
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        runs = []
        for in_flight in (False, True):
            core.pipeline = AsyncSteps(core) if in_flight else None
            core.kv.reset_prefix_cache()
            runs.append([list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)])
            assert core.kv.num_free_blocks == core.kv.num_blocks
        assert core.scheduler.num_preemptions > 0  # the cache is small enough to force it
        assert runs[1] == runs[0]
    finally:
        _release(llm)


def test_a_decode_step_is_launched_and_sampled_without_a_host_sync():
    """Under torch's sync debug mode "error", any call that makes the host wait for the
    device raises: none may happen between scheduling a decode step and its sampled tokens."""
    from kvfleet.runtime import SamplingParams

    llm = _engine(eager=False)
    try:
        core = llm.engine.core
        launch, sample = core.launch, core.sampler.sample
        checked = []

        def strict(call, decoding):
            def run(*args, **kwargs):
                if not decoding(args):
                    return call(*args, **kwargs)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return call(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    checked.append(call.__name__)

            return run

        def decode_batch(args) -> bool:
            return all(r.is_decoding for r in args[0].requests)

        def greedy_rows(args) -> bool:
            return all(r.params.greedy for r in args[1])

        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        first = llm.generate(PROMPTS[:8], params)
        # Each stops on its 4th token, which is read while the next step runs: that step's
        # rows for it are dropped before sampling.
        stops = [
            SamplingParams(max_tokens=32, temperature=0, min_tokens=2,
                           stop_token_ids=[o.outputs[0].token_ids[3]])
            for o in first
        ]  # fmt: skip
        core.launch = strict(launch, decode_batch)
        core.sampler.sample = strict(sample, greedy_rows)
        llm.generate(PROMPTS[:8], params)
        stopped = llm.generate(PROMPTS[:8], stops)
        assert any(o.outputs[0].finish_reason == "stop" for o in stopped)
        assert checked.count("launch") > 20 and checked.count("sample") > 20
    finally:
        _release(llm)

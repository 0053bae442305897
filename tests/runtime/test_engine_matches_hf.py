"""Greedy generation through the whole engine (scheduler, paged KV cache, batching) gives the
same tokens as Hugging Face transformers' `generate`, float32, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.model_runner import kv_bytes_per_token

PROMPT_LENS = (3, 17, 33, 64, 90)
MAX_NEW = 24


def _prompts(seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (n,), generator=g).tolist() for n in lens]


_hf_cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy(folder: Path, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    key = (str(folder), (*prompt, -max_new))
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = _hf_models.setdefault(
            str(folder), AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        )
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
        _hf_cache[key] = out[0, len(prompt) :].tolist()
    return _hf_cache[key]


_hf_models: dict[str, object] = {}


def _greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0.0)


@pytest.fixture(params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_batched_greedy_matches_hf_for_every_block_size(model_dir: Path, block_size: int) -> None:
    llm = LLM(str(model_dir), dtype="float32", block_size=block_size, max_model_len=256)
    prompts = _prompts()
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_and_unchunked_prefill_match_hf(tiny_llama_dir: Path, chunked: bool) -> None:
    # A 24-token step budget splits the longer prompts over several steps when chunking is on
    # and forces one-prompt-per-step admission when it is off.
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=24 if chunked else 96,
        enable_chunked_prefill=chunked,
    )
    prompts = _prompts(seed=1)
    outs = llm.generate(prompts, _greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt)


def test_prefix_cache_hit_matches_hf(tiny_qwen2_dir: Path) -> None:
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", max_model_len=256, block_size=8)
    shared = _prompts(seed=2, lens=(70,))[0]
    first = [*shared, 11, 12, 13]
    second = [*shared, 21, 22, 23, 24, 25]
    (out1,) = llm.generate([first], _greedy())
    assert out1.num_cached_tokens == 0
    (out2,) = llm.generate([second], _greedy())
    assert out2.num_cached_tokens == 64  # the 8 full blocks of the shared 70 tokens
    assert llm.engine.kv.stats.hits >= 64
    assert out2.outputs[0].token_ids == hf_greedy(tiny_qwen2_dir, second)
    assert out1.outputs[0].token_ids == hf_greedy(tiny_qwen2_dir, first)


def test_forced_preemption_still_matches_hf(tiny_llama_dir: Path) -> None:
    from kvfleet.runtime.models.config import ModelConfig

    mc = ModelConfig.from_folder(tiny_llama_dir)
    # 16 blocks of 8 tokens: five requests of up to 90+24 tokens cannot all stay resident.
    budget = 16 * 8 * kv_bytes_per_token(mc, torch.float32)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=8,
        max_model_len=128,
        kv_cache_memory=budget,
        enable_prefix_caching=False,
    )
    prompts = _prompts(seed=3, lens=(20, 30, 40, 25, 35))
    outs = llm.generate(prompts, _greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks

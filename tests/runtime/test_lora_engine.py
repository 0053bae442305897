"""LoRA adapters in the engine, as a user of `LLM(..., enable_lora=True)` sees them: each
adapter gives the tokens of the base model with that adapter merged into its weights (PEFT's
`merge_and_unload`, float32, transformers' greedy decoding), alone or mixed with other adapters
and the base model in one batch, and the prefix cache never hands one adapter's KV to another.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.lora_request import LoRARequest
from kvfleet.runtime.engine.sampling_params import SamplingParams
from lora_adapters import greedy_tokens_batch, merged_model

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def bundled_llm() -> LLM:
    return LLM("bundled", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def prompts(bundled_llm: LLM) -> list[list[int]]:
    """16 prompts of one length, so that transformers computes them in one unpadded batch."""
    tok = bundled_llm.tokenizer
    topics = ["France", "rivers", "the moon", "bread", "chess", "rain", "Python", "music"]
    ids = [
        tok.encode(f"{kind} about {topic} that everyone should know:")
        for kind in ("A short fact", "A question")
        for topic in topics
    ]
    shortest = min(len(p) for p in ids)
    return [p[:shortest] for p in ids]


@pytest.mark.parametrize("which", [0, 1], ids=["every-projection", "attention-only"])
def test_adapter_gives_the_merged_models_greedy_tokens(
    bundled_llm, prompts, bundled_dir, bundled_lora_dirs, which
):
    adapter = bundled_lora_dirs[which]
    lora = LoRARequest(adapter.name, which + 1, str(adapter))
    got = [o.outputs[0].token_ids for o in bundled_llm.generate(prompts, GREEDY, lora)]
    merged = merged_model(bundled_dir, adapter)
    eos = bundled_llm.tokenizer.eos_token_id
    want = greedy_tokens_batch(merged, prompts, GREEDY.max_tokens, eos)
    assert got == want
    base = [o.outputs[0].token_ids for o in bundled_llm.generate(prompts, GREEDY)]
    assert base != got  # the adapter does change the model's answers


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(
        str(tiny_llama_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        kv_cache_memory="32MiB",
    )


def _tiny_prompts(n: int) -> list[list[int]]:
    return [[1, 17 + i, 4000 + 7 * i, 93, 250 + i, 11, 3 * i + 5] for i in range(n)]


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_its_own_tokens(
    tiny_llm, tiny_lora_dirs
):
    loras = [None] + [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(tiny_lora_dirs)]
    prompts = _tiny_prompts(10)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assignment = [loras[i % len(loras)] for i in range(len(prompts))]
    together = tiny_llm.generate(prompts, params, assignment)
    alone = [
        tiny_llm.generate([p], params, lora)[0] for p, lora in zip(prompts, assignment, strict=True)
    ]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    # Five different models: the same prompt gets five different continuations.
    same_prompt = tiny_llm.generate([prompts[0]] * 5, params, loras)
    assert len({tuple(o.outputs[0].token_ids) for o in same_prompt}) == 5


def test_more_adapters_than_slots_all_finish_with_their_own_tokens(tiny_llama_dir, tiny_lora_dirs):
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
        max_cpu_loras=2, kv_cache_memory="32MiB",
    )  # fmt: skip
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(tiny_lora_dirs)]
    prompts = _tiny_prompts(8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assignment = [loras[i % 4] for i in range(8)]
    together = llm.generate(prompts, params, assignment)
    alone = [
        llm.generate([p], params, lora)[0] for p, lora in zip(prompts, assignment, strict=True)
    ]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_the_same_prompt_under_two_adapters_never_shares_cached_blocks(tiny_llm, tiny_lora_dirs):
    a, b = (LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(tiny_lora_dirs[:2]))
    prompt = [1, *range(300, 363)]  # four full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = tiny_llm.generate([prompt], params, a)[0]
    other = tiny_llm.generate([prompt], params, b)[0]
    base = tiny_llm.generate([prompt], params)[0]
    again = tiny_llm.generate([prompt], params, a)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # its own blocks, the last one left to compute
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_an_adapter_id_names_one_adapter(tiny_llm, tiny_lora_dirs):
    from kvfleet.runtime.engine.request_limits import RequestError

    a = LoRARequest("first", 7, str(tiny_lora_dirs[0]))
    tiny_llm.generate([[1, 2, 3]], GREEDY, a)
    with pytest.raises(RequestError, match="lora_int_id 7 is adapter 'first', not 'second'"):
        tiny_llm.generate([[1, 2, 3]], GREEDY, LoRARequest("second", 7, str(tiny_lora_dirs[1])))


def test_lora_needs_enable_lora(tiny_llama_dir, tiny_lora_dirs):
    from kvfleet.runtime.models.lora import LoraError

    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB")
    lora = LoRARequest("a", 1, str(tiny_lora_dirs[0]))
    with pytest.raises(LoraError, match="start with --enable-lora"):
        llm.generate([[1, 2, 3]], GREEDY, lora)


def test_a_step_with_adapters_runs_op_by_op_and_one_without_keeps_the_fused_step(
    tiny_llm, tiny_lora_dirs, monkeypatch
):
    """The fused decode paths cannot add adapters: a step with one leaves them, a base-only
    step still takes them (the same tokens either way, checked above)."""
    runner = tiny_llm.engine.runner
    seen: list[bool] = []
    forward = type(tiny_llm.engine.model).forward

    def spy(self, *args, **kwargs):
        lora = args[5] if len(args) > 5 else kwargs.get("lora")
        seen.append(lora is not None)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_llm.engine.model), "forward", spy)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = tiny_lora_dirs[0]
    tiny_llm.generate([[1, 5, 9]], params, LoRARequest(first.name, 1, str(first)))
    assert seen and all(seen)
    seen.clear()
    tiny_llm.generate([[1, 5, 9]], params)
    assert not any(seen)
    assert runner.loras is not None and torch.count_nonzero(runner.loras.stacks[0]["o_proj"][0])


def test_an_adapter_whose_files_vanished_fails_its_request_not_the_engine(
    tiny_llama_dir, tiny_lora_dirs, tmp_path
):
    """One slot and one read copy: the first adapter must be read again when next used; its
    folder is gone by then, so that request fails with why, and the engine serves on."""
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
        max_lora_rank=16, kv_cache_memory="16MiB",
    )  # fmt: skip
    doomed = shutil.copytree(tiny_lora_dirs[0], tmp_path / "doomed")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, LoRARequest("doomed", 1, str(doomed)))
    llm.generate([[1, 2, 3]], params, LoRARequest("other", 2, str(tiny_lora_dirs[1])))
    shutil.rmtree(doomed)
    failed, base = llm.generate(
        [[1, 2, 3], [4, 5, 6]], params, [LoRARequest("doomed", 1, str(doomed)), None]
    )
    assert failed.outputs[0].finish_reason == "error"
    assert "adapter 'doomed'" in failed.error and "is not a folder" in failed.error
    assert base.outputs[0].finish_reason == "length" and len(base.outputs[0].token_ids) == 4

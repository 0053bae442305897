"""Prompt log-probabilities (`SamplingParams(prompt_logprobs=k)`) equal Hugging Face
transformers' float32 forward pass, whether the prompt arrives in one step or in chunks, after
a prefix-cache hit, with n > 1 and across preemption by recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvfleet.runtime import LLM, SamplingParams
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.model_runner import kv_bytes_per_token
from kvfleet.runtime.engine.request import Request, RequestOutput
from kvfleet.runtime.engine.sampling_params import MAX_LOGPROBS, SamplingParamsError
from kvfleet.runtime.models.config import ModelConfig

TOL = 1e-4
TOP_K = 3


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (length,), generator=g).tolist()


_hf: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
_hf_models: dict[str, torch.nn.Module] = {}


def hf_logprobs(folder: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 log_softmax of transformers' logits at each position."""
    key = (str(folder), tuple(prompt))
    if key not in _hf:
        from transformers import AutoModelForCausalLM

        if str(folder) not in _hf_models:
            _hf_models[str(folder)] = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32
            )
        with torch.inference_mode():
            logits = _hf_models[str(folder)](torch.tensor([prompt])).logits[0]
        _hf[key] = torch.log_softmax(logits.float(), dim=-1)
    return _hf[key]


def assert_matches_hf(folder: Path, prompt: list[int], out: RequestOutput, k: int) -> None:
    ref = hf_logprobs(folder, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        e = got[i]
        assert e is not None and e.token_id == prompt[i]
        want = ref[i - 1, prompt[i]].item()
        assert e.logprob == pytest.approx(want, abs=TOL), f"prompt token {i}"
        want_top = ref[i - 1].topk(k).values.tolist() if k else []
        assert [lp for _, lp in e.top] == pytest.approx(want_top, abs=TOL), f"top at {i}"
        for token_id, lp in e.top:
            assert lp == pytest.approx(ref[i - 1, token_id].item(), abs=TOL)


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **kw})  # type: ignore[arg-type]


def _chunking_llm(folder: Path) -> LLM:
    """8-token blocks and a 12-token step budget: a long prompt is scored over several steps,
    with chunk boundaries both inside blocks and on their edges."""
    return LLM(
        str(folder), dtype="float32", block_size=8, max_model_len=256, max_num_batched_tokens=12
    )


def test_chunked_prefix_hit_and_n2_match_hf(tiny_llama_dir: Path) -> None:
    llm = _chunking_llm(tiny_llama_dir)
    shared = _prompt(61, seed=0)
    (first,) = llm.generate([shared], _params(prompt_logprobs=TOP_K))
    assert_matches_hf(tiny_llama_dir, shared, first, TOP_K)

    # Without prompt logprobs the next request hits the cached blocks of `shared`...
    second_prompt = [*shared[:56], 5, 6, 7]
    (plain,) = llm.generate([second_prompt], _params())
    assert plain.num_cached_tokens == 56
    assert plain.prompt_logprobs is None
    # ...but a request that wants them computes every position, and is still right.
    (scored,) = llm.generate([second_prompt], _params(prompt_logprobs=0, n=2))
    assert scored.num_cached_tokens == 0
    assert_matches_hf(tiny_llama_dir, second_prompt, scored, 0)
    assert [len(c.token_ids) for c in scored.outputs] == [4, 4]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_every_output_of_an_n_group_carries_the_whole_scored_prompt(
    tiny_llama_dir: Path,
) -> None:
    llm = _chunking_llm(tiny_llama_dir)
    prompt = _prompt(50, seed=1)
    llm.generate([prompt], _params())  # cache the whole prompt
    # The first sibling scores 50 positions in 12-token chunks, bypassing the cache; the
    # others may hit it. Every output the group streams has the whole prompt scored.
    engine = llm.engine
    engine.add_request("g", prompt, _params(prompt_logprobs=1, n=3, max_tokens=6))
    seen: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert seen and all(out.prompt_logprobs is not None for out in seen)
    assert all(len(out.prompt_logprobs or []) == len(prompt) for out in seen)
    final = seen[-1]
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [6, 6, 6]
    assert_matches_hf(tiny_llama_dir, prompt, final, 1)


def test_preemption_by_recompute_neither_duplicates_nor_loses_entries(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfleet.runtime.engine.scheduler import Scheduler

    owed_at_preemption: list[int | None] = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, request: Request, batch: object) -> None:
        owed_at_preemption.append(request.prompt_logprob_position)
        preempt(self, request, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    mc = ModelConfig.from_folder(tiny_llama_dir)
    # 13 blocks of 8 tokens for four prompts of 35-50 tokens plus 20 new ones each: requests
    # are preempted, some with their prompt half scored, and recomputed (re-hitting the
    # blocks whose positions were already scored).
    budget = 13 * 8 * kv_bytes_per_token(mc, torch.float32)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=8,
        max_model_len=96,
        kv_cache_memory=budget,
        max_num_batched_tokens=16,
    )
    prompts = [_prompt(n, seed=10 + n) for n in (40, 45, 50, 35)]
    outs = llm.generate(prompts, _params(prompt_logprobs=2, max_tokens=20, ignore_eos=True))
    assert any(owed is not None and owed >= 8 for owed in owed_at_preemption)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(tiny_llama_dir, prompt, out, 2)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_one_token_prompt_has_only_the_null_entry(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    (out,) = llm.generate([[42]], _params(prompt_logprobs=5))
    assert out.prompt_logprobs == [None]


def test_a_prefix_hit_stops_at_the_first_position_still_owing_a_logprob() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 18))
    plain = Request("a", tokens, SamplingParams(), frozenset(), 4)
    assert kv.allocate_slots(plain, len(tokens))
    scored = Request("b", tokens, SamplingParams(prompt_logprobs=0), frozenset(), 4)
    assert kv.get_computed_blocks(scored) == ([], 0)
    # Positions 0..9 scored (entries for tokens 0..10): blocks up to position 9 may be reused.
    scored.prompt_logprobs = [None] + [None] * 10  # only the count matters here
    _blocks, n = kv.get_computed_blocks(scored)
    assert n == 8
    scored.prompt_logprobs = [None] * len(tokens)  # all scored: the ordinary hit applies
    _blocks, n = kv.get_computed_blocks(scored)
    assert n == 16


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1])
def test_bad_prompt_logprobs_is_rejected_naming_the_field(bad: int) -> None:
    with pytest.raises(SamplingParamsError, match=r"prompt_logprobs: must be in \[0, 20\]") as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.field == "prompt_logprobs"

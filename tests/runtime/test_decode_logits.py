"""The one-call CPU decode step (kernels/cpu/cpu_decode_logits.py: token ids to logits in one C
call) gives the two-call path's logits (the model's forward, then compute_logits) to the bit and
writes the same cache bytes; the engine takes it for decode-only steps, with the same tokens and
log-probabilities as an engine whose kernel policy turns it off; a token id outside the
vocabulary is refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_decode_logits, cpu_gemm, cpu_gemm_f32
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.loader import load_model
from paged_decoder import Decoder

BF16 = torch.bfloat16


# The engine's kernel policy with the one call off: decode steps in two calls.
TWO_CALLS = KernelPolicy(one_call_max_rows=0)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)


def _model(folder: Path, dtype: torch.dtype, policy: KernelPolicy = DEFAULT_POLICY) -> LlamaModel:
    if dtype == BF16 and not cpu_gemm.available():
        pytest.skip("no bf16 GEMM engine here (tests/kernels/test_cpu_gemm.py says which)")
    if dtype == torch.float32 and not cpu_gemm_f32.available():
        pytest.skip("no AVX-512 or AVX2 here (tests/kernels/test_cpu_gemm_f32.py asserts where)")
    net, _, _ = load_model(str(folder), dtype, "cpu", policy=policy)
    net.prepack()
    return net


def _one_call(net: LlamaModel, run: Decoder, rows: int) -> cpu_decode_logits.DecodeLogits:
    stack = net.build_decode_stack(run.kv)
    assert stack is not None
    one_call = net.build_decode_logits(stack, rows, run.tables.shape[1])
    assert one_call is not None
    return one_call


def _assert_same_steps(net: LlamaModel, lengths: list[int], steps: int) -> None:
    """`steps` decode steps one-call and two-call from the same state: the same logits, and
    cache bytes."""
    one = Decoder(net, lengths)
    two = one.fork()
    one_call = _one_call(net, one, len(lengths))
    for step in range(steps):  # later steps read what the first wrote
        got, argmax = one.decode_one_call(one_call, argmax=step % 2 == 1)
        with torch.inference_mode():
            want = net.compute_logits(two.decode())
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want)
        # Asked, the argmaxes greedy sampling would take from these logits; else none.
        assert argmax == (dispatch.argmax(want).tolist() if step % 2 == 1 else None)
    for (k1, v1), (k2, v2) in zip(one.kv, two.kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied LM head; a tied one, biases
@pytest.mark.parametrize("num_seqs", [1, 7])
def test_bf16_one_call_logits_match_forward_then_compute_logits(
    arch, num_seqs, bf16_gemm_engine, tiny_llama_dir, tiny_qwen2_dir
):
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    lengths = torch.randint(1, 60, (num_seqs,), generator=torch.Generator().manual_seed(3))
    _assert_same_steps(_model(folder, BF16, bf16_gemm_engine.policy), lengths.tolist(), 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_one_call_logits_match_forward_then_compute_logits(
    arch, tiny_llama_dir, tiny_qwen2_dir
):
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    lengths = [5, 33, 17, 2][: max(cpu_gemm_f32.MIN_ROWS, 4)]
    _assert_same_steps(_model(folder, torch.float32), lengths, 4)


def test_a_token_id_outside_the_vocabulary_is_refused_and_writes_no_cache(tiny_llama_dir):
    net = _model(tiny_llama_dir, BF16 if cpu_gemm.available() else torch.float32)
    run = Decoder(net, [4, 6])
    one_call = _one_call(net, run, 2)
    before = [(k.clone(), v.clone()) for k, v in run.kv]
    vocab = net.embed_tokens.shape[0]
    bad = [3, vocab]
    with pytest.raises(IndexError, match=f"token id is outside \\[0, {vocab}\\)"):
        one_call.run(bad, [4, 6], [0, 16], [5, 7], [[0], [1]], policy=net.kernels.policy)
    for (k1, v1), (k2, v2) in zip(run.kv, before, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_steps_past_its_rows_or_blocks_or_with_the_fused_step_off_are_not_taken(tiny_llama_dir):
    net = _model(tiny_llama_dir, BF16 if cpu_gemm.available() else torch.float32)
    run = Decoder(net, [4, 6, 9, 3])
    one_call = _one_call(net, run, 4)
    blocks = run.tables.shape[1]
    policy = net.kernels.policy
    assert one_call.accepts(4, blocks, policy)
    assert not one_call.accepts(5, blocks, policy)  # more sequences than its buffers hold
    assert not one_call.accepts(4, blocks + 1, policy)  # a longer block table
    assert not one_call.accepts(4, blocks, replace(policy, fused_decode_step=False))


def test_no_one_call_without_the_fused_stack(tiny_llama_dir):
    unpacked, _, _ = load_model(str(tiny_llama_dir), BF16, "cpu")  # not prepacked
    run = Decoder(unpacked, [3])
    assert unpacked.build_decode_stack(run.kv) is None  # so no one-call step is built over it


def test_engine_decodes_in_one_call_with_the_two_call_paths_tokens_and_logprobs(
    tiny_llama_dir, one_calls
):
    dtype = "bfloat16" if cpu_gemm.available() else "float32"
    if dtype == "float32" and not cpu_gemm_f32.available():
        pytest.skip("no C GEMM here: the fused steps need one")
    calls = one_calls
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for one_call in (True, False):
        policy = DEFAULT_POLICY if one_call else TWO_CALLS
        with LLM(
            str(tiny_llama_dir),
            dtype=dtype,
            max_model_len=128,
            max_num_seqs=4,
            kernel_policy=policy,
        ) as llm:
            results[one_call] = [o.outputs[0] for o in llm.generate(prompts, params)]
        if one_call:
            assert calls and set(calls) == {2}  # both sequences decoded together, in one call
            calls.clear()
    assert calls == []
    for got, want in zip(results[True], results[False], strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


def test_steps_with_a_one_token_prompt_chunk_keep_the_two_call_path(tiny_llama_dir, caplog):
    """A two-token budget schedules a decode beside a one-token chunk of the next prompt: one
    token per sequence, but the chunk's row is not sampled. Such steps keep the two-call path
    (the one call's logits would have a row no request takes): the same tokens as without the
    one call, and no sampling failure."""
    dtype = "bfloat16" if cpu_gemm.available() else "float32"
    if dtype == "float32" and not cpu_gemm_f32.available():
        pytest.skip("no C GEMM here: the fused steps need one")
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options = dict(dtype=dtype, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=2)
    results = {}
    for one_call in (True, False):
        policy = DEFAULT_POLICY if one_call else TWO_CALLS
        with (
            LLM(
                str(tiny_llama_dir), enable_chunked_prefill=True, kernel_policy=policy, **options
            ) as llm,
            caplog.at_level("WARNING"),
        ):
            results[one_call] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results[True] == results[False]
    assert not [r for r in caplog.records if "sampling" in r.getMessage()]

"""The engine with the Triton kernels forced by its kernel policy (CUDA's path, run by the
interpreter on CPU) must produce the same greedy tokens as the torch reference path on a tiny
model."""

import pytest
from kvfleet.kernels.policy import KernelPolicy

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Hello",
    # Shares its first blocks with the first prompt: exercises prefix-cache hits.
    "The quick brown fox jumps over the lazy dog because it was",
]

# A small step budget chunks the prompts across steps, so batches mix decodes with prefill
# chunks whose earlier part is already cached.
ENGINE_SETUPS = {
    "defaults": dict(),
    "chunked-mixed": dict(block_size=8, max_num_batched_tokens=12),
    # Both paths store the same fp8 values and widen them to float32 to attend.
    "fp8-kv-cache": dict(block_size=8, max_num_batched_tokens=12, kv_cache_dtype="fp8"),
}


@pytest.fixture
def tiny_model(request) -> str:
    """The tiny random Llama from tests/conftest.py (skips while that fixture does not exist)."""
    try:
        return str(request.getfixturevalue("tiny_llama_dir"))
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py provides no tiny_llama_dir fixture yet")


def _greedy_tokens(model: str, backend: str, setup: dict) -> list[list[int]]:
    from kvfleet.runtime import LLM, SamplingParams

    policy = KernelPolicy(backend=backend)
    llm = LLM(model=model, dtype="float32", max_model_len=256, kernel_policy=policy, **setup)
    assert llm.engine.model.kernels.policy is policy  # the engine's model runs the given one
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("setup", ENGINE_SETUPS.values(), ids=ENGINE_SETUPS.keys())
def test_triton_path_generates_the_same_greedy_tokens(tiny_model, setup, monkeypatch):
    want = _greedy_tokens(tiny_model, "torch", setup)

    from kvfleet.kernels import reference

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran while the Triton backend was forced")

    with monkeypatch.context() as m:
        for name in ("reshape_and_cache", "paged_attention", "rms_norm", "silu_and_mul",
                     "rotary_embedding"):  # fmt: skip
            m.setattr(reference, name, refuse)
        got = _greedy_tokens(tiny_model, "triton", setup)

    assert len(want) == len(PROMPTS) and all(want)
    assert got == want


def test_triton_path_runs_lora_adapters_mixed_with_the_base_model(request, tiny_model):
    """CUDA's LoRA path (Triton's gather kernels) gives the CPU path's tokens for a batch
    mixing two adapters and the base model."""
    from kvfleet.runtime import LLM, SamplingParams
    from kvfleet.runtime.engine.lora_request import LoRARequest

    paths = request.getfixturevalue("tiny_lora_dirs")
    loras = [None, LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))]

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(
            model=tiny_model, dtype="float32", max_model_len=256, enable_lora=True,
            max_lora_rank=16, kernel_policy=KernelPolicy(backend=backend),
        )  # fmt: skip
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, loras)
        return [list(o.outputs[0].token_ids) for o in outs]

    assert tokens("triton") == tokens("torch")


def test_triton_path_runs_a_quantized_checkpoint(request, tiny_model, tmp_path):
    """CUDA's quantized path (Triton's GEMM dequantizing 4-bit weights in registers) gives the
    tokens of the same weights dequantized into a plain model."""
    from pathlib import Path

    from kvfleet.runtime import LLM, SamplingParams
    from quantized_checkpoints import write_quantized

    awq, dequantized = write_quantized(Path(tiny_model), tmp_path, "awq")

    def tokens(model: Path, backend: str) -> list[list[int]]:
        llm = LLM(model=str(model), dtype="float32", max_model_len=256,
                  kernel_policy=KernelPolicy(backend=backend))  # fmt: skip
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]

    assert tokens(awq, "triton") == tokens(dequantized, "torch")

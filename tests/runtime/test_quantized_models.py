"""Quantized checkpoints served as they are published: AWQ, GPTQ, compressed-tensors (packed
int4 and FP8) and FP8 folders made by the tests from a tiny random model, and the bundled
model's own Q4_1 GGUF, each giving the same greedy tokens as the same weights dequantized into
a plain float32 model; and the start-up errors a scheme kvfleet cannot run gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fake_hub import fake_hub
from kvfleet.kernels.quant_weight import QuantizedWeight
from kvfleet.runtime.engine.llm import LLM
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.models.errors import ModelLoadError
from quantized_checkpoints import FORMATS, write_quantized

PROMPTS = 16
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist()
        for n in torch.randint(4, 40, (PROMPTS,), generator=gen)
    ]


def greedy(model: str | Path, ids: list[list[int]], **engine) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", max_model_len=256, **engine)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir: Path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: write_quantized(tiny_llama_dir, root, fmt) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_equal_the_dequantized_models(checkpoints, fmt):
    quant, ref = checkpoints[fmt]
    ids = prompts(49152)
    assert greedy(quant, ids) == greedy(ref, ids)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct-int4"])
def test_four_bit_weights_stay_quantized(checkpoints, fmt):
    llm = LLM(model=str(checkpoints[fmt][0]), max_model_len=64)
    try:
        layer = llm.engine.model.layers[0]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = getattr(layer, name)
            assert isinstance(weight, QuantizedWeight) and weight.format == "int4", name
        assert llm.engine.dtype == torch.float32  # auto on CPU for a quantized model
    finally:
        llm.close()


def test_an_awq_model_from_the_hub(checkpoints, monkeypatch, tmp_path):
    quant, ref = checkpoints["awq"]
    ids = prompts(49152, seed=1)[:4]
    with fake_hub({"org/tiny-awq": quant}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        assert greedy("org/tiny-awq", ids) == greedy(ref, ids)


def test_the_bundled_gguf_stays_q4_and_matches_its_dequantized_tokens(bundled_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_dir))
    texts = [
        "The capital of France is", "def fibonacci(n):", "List three colors:",
        "Write a haiku about the sea.", "The quick brown fox", "1, 2, 3, 4,",
        "Translate to French: good morning", "Once upon a time", "import numpy as np",
        "The largest planet is", "Water boils at", "A recipe for pancakes:",
        "SELECT * FROM", "The meaning of life is", "Dear hiring manager,", "In 1969,",
    ]  # fmt: skip
    ids = [tok(t)["input_ids"] for t in texts]
    assert len(ids) == PROMPTS
    llm = LLM(model="bundled", max_model_len=256)
    try:
        model = llm.engine.model
        assert model.layers[0].qkv_proj.format == "int4"  # Q4_1 blocks
        assert model.lm_head.format == "int8"  # the tied Q8_0 embedding table
        kept = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)]
    finally:
        llm.close()
    assert kept == greedy("bundled", ids, quantization="none")


def _with_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "config,message",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3-bit weights"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ],
)
def test_an_unsupported_scheme_is_a_start_up_error_naming_it(tiny_llama_dir, tmp_path, config,
                                                               message):  # fmt: skip
    folder = _with_config(tiny_llama_dir, tmp_path / "m", config)
    with pytest.raises(ModelLoadError, match=message) as err:
        LLM(model=str(folder))
    assert "supported" in str(err.value)


def test_quantization_flag_must_match_the_checkpoint(checkpoints, tiny_llama_dir):
    with pytest.raises(ModelLoadError, match=r"--quantization gptq .* checkpoint is awq"):
        LLM(model=str(checkpoints["awq"][0]), quantization="gptq")
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        LLM(model=str(tiny_llama_dir), quantization="awq")


def test_gptq_with_reordered_groups_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "act-order"
    shutil.copytree(checkpoints["gptq"][0], folder)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="desc_act"):
        LLM(model=str(folder))

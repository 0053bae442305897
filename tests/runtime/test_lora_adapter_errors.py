"""Adapters that cannot run on the model are refused with their name and the reason, before
any request runs them: what `--lora-modules` and /v1/load_lora_adapter report to the user."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvfleet.runtime.models.loader import load_config
from kvfleet.runtime.models.lora import LoraError, load_lora_adapter
from lora_adapters import make_lora_adapter
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def config(tiny_llama_dir: Path):
    return load_config(tiny_llama_dir)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_good_adapter_loads_with_its_scaling_folded_in(config, tiny_lora_dirs):
    adapter = load_lora_adapter("good", tiny_lora_dirs[0], config, 16)
    assert adapter.rank == 8 and len(adapter.weights) == 2 * 7  # 2 layers, 7 projections
    a, b = adapter.weights[(0, "q_proj")]
    assert a.shape == (8, 64) and b.shape == (64, 8)


def test_rank_above_the_limit(config, tiny_lora_dirs):
    with pytest.raises(LoraError, match=r"adapter 'big': rank 16 exceeds --max-lora-rank 8"):
        load_lora_adapter("big", tiny_lora_dirs[2], config, 8)


def test_a_module_the_model_does_not_have(config, tiny_llama_dir, tmp_path):
    path = make_lora_adapter(
        tiny_llama_dir, tmp_path / "head", target_modules=("q_proj", "lm_head")
    )
    with pytest.raises(LoraError, match=r"adapter 'head': weight .*lm_head.* not a LoRA A/B"):
        load_lora_adapter("head", path, config, 16)


def test_an_adapter_of_another_base_model(config, tmp_path):
    other = make_tiny_model(tmp_path / "other", hidden_size=32, intermediate_size=64)
    path = make_lora_adapter(other, tmp_path / "other-lora")
    with pytest.raises(LoraError, match=r"adapter 'other': .* not this base model"):
        load_lora_adapter("other", path, config, 16)


def test_missing_files(config, tiny_lora_dirs, tmp_path):
    no_weights = _copy(tiny_lora_dirs[0], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match=r"has no adapter_model\.safetensors"):
        load_lora_adapter("w", no_weights, config, 16)
    no_config = _copy(tiny_lora_dirs[0], tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoraError, match=r"has no adapter_config\.json"):
        load_lora_adapter("c", no_config, config, 16)
    with pytest.raises(LoraError, match="is not a folder"):
        load_lora_adapter("gone", tmp_path / "nowhere", config, 16)


def test_corrupt_files(config, tiny_lora_dirs, tmp_path):
    cut = _copy(tiny_lora_dirs[0], tmp_path / "cut")
    weights = cut / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(
        LoraError, match=r"adapter 'cut': adapter_model\.safetensors cannot be read"
    ):
        load_lora_adapter("cut", cut, config, 16)
    garbled = _copy(tiny_lora_dirs[0], tmp_path / "garbled")
    (garbled / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match=r"adapter_config\.json cannot be read"):
        load_lora_adapter("garbled", garbled, config, 16)


def test_variants_whose_weights_mean_something_else(config, tiny_lora_dirs, tmp_path):
    dora = _copy(tiny_lora_dirs[0], tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoraError, match="adapter 'dora': use_dora True is not supported"):
        load_lora_adapter("dora", dora, config, 16)

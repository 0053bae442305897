"""Session fixtures shared by the runtime tests: the bundled model and tiny random models.

KVFLEET_CACHE_DIR is left alone so repeated runs reuse the one-time GGUF conversion in
~/.cache/kvfleet."""

from __future__ import annotations

from pathlib import Path

import pytest
from bf16_engines import ENGINES, Bf16Engine, bf16_engine
from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted to a safetensors folder (cached)."""
    from kvfleet.runtime.models.model_files import resolve_model

    return resolve_model("bundled")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """A 2-layer random Llama (untied embeddings) with the bundled tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """A 3-layer random Qwen2 (tied embeddings, q/k/v biases) with the bundled tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_d64(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """head_dim 64, the shape whose attention and prefill run on AMX tiles (the other tiny
    models' 16 take the vector paths)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"),
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(params=ENGINES)
def bf16_gemm_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Bf16Engine:
    """Each engine of the bf16 decode-sized GEMM in turn, with the kernel policy that runs it
    (`bf16_engines.bf16_engine`)."""
    return bf16_engine(monkeypatch, request.param)


@pytest.fixture(scope="session")
def tiny_lora_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> list[Path]:
    """Four random PEFT adapters of the tiny Llama: ranks 8, 4, 16 and 8, on every projection,
    on q/v only, on the MLP only, and on every projection again (another seed)."""
    from lora_adapters import make_lora_adapter

    root = tmp_path_factory.mktemp("tiny-loras")
    specs = [
        {"rank": 8, "seed": 1, "std": 0.1},
        {"rank": 4, "seed": 2, "target_modules": ("q_proj", "v_proj"), "std": 0.3},
        {"rank": 16, "seed": 3, "target_modules": ("gate_proj", "up_proj", "down_proj")},
        {"rank": 8, "seed": 4, "std": 0.1, "use_rslora": True},
    ]
    return [
        make_lora_adapter(tiny_llama_dir, root / f"lora{i}", **spec) for i, spec in enumerate(specs)
    ]


@pytest.fixture(scope="session")
def bundled_lora_dirs(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> list[Path]:
    """Two random rank-8 PEFT adapters of the bundled model (every projection; q/k/v/o only)."""
    from lora_adapters import make_lora_adapter

    root = tmp_path_factory.mktemp("bundled-loras")
    return [
        make_lora_adapter(bundled_dir, root / "all", seed=11, std=0.02),
        make_lora_adapter(
            bundled_dir,
            root / "attention",
            seed=12,
            std=0.03,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    ]

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
    from kvfleet.runtime.models.loader import resolve_model

    return resolve_model("bundled")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """A 2-layer random Llama (untied embeddings) with the bundled tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, bundled_dir: Path) -> Path:
    """A 3-layer random Qwen2 (tied embeddings, q/k/v biases) with the bundled tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(params=ENGINES)
def bf16_gemm_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Bf16Engine:
    """Each engine of the bf16 decode-sized GEMM in turn, with the kernel policy that runs it
    (`bf16_engines.bf16_engine`)."""
    return bf16_engine(monkeypatch, request.param)

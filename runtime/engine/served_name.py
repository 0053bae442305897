"""The model name the API answers to, derived from --model unless --served-model-name is given."""

from __future__ import annotations

from pathlib import Path

from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.models.hub import is_hub_id

BUNDLED_NAME = "SmolLM2-135M-Instruct"


def served_model_name(config: EngineConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    model = config.model
    if model == "bundled":
        return BUNDLED_NAME
    if model.startswith("random:") or is_hub_id(model):
        return model  # a Hub id is served under its full name, as vLLM does
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name or model)

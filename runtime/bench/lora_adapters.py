"""Random LoRA adapters of a model's shape, in PEFT's format, for benchmarks: what an adapter
costs depends on its rank and the projections it targets, not on its values."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kvfleet.runtime.engine.lora_request import LoRARequest
from kvfleet.runtime.models.config import ModelConfig
from kvfleet.runtime.models.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE, module_shapes


def write_random_adapters(
    config: ModelConfig, count: int, rank: int, folder: Path, seed: int = 0
) -> list[LoRARequest]:
    """`count` rank-`rank` adapters on every projection of every layer, written under `folder`
    (one PEFT folder each), as the requests that name them (ids 1..count)."""
    from safetensors.torch import save_file

    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        path = folder / f"bench-lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config.num_layers):
            for module in TARGETS:
                out, inp = shapes[module]
                kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator)
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.01
        save_file(tensors, str(path / WEIGHTS_FILE))
        adapter_config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
            "bias": "none",
        }
        (path / CONFIG_FILE).write_text(json.dumps(adapter_config))
        requests.append(LoRARequest(path.name, i + 1, str(path)))
    return requests

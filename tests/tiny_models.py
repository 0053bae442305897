"""Tiny random Llama-family models built with transformers, for tests that need no download.

`make_tiny_model(path, arch)` writes a Hugging Face folder (config.json, model.safetensors and
the bundled model's tokenizer files, so its chat template works) and returns the path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

# The bundled tokenizer's vocabulary: tiny models share it, so it can serve them.
TINY_VOCAB = 49152
_NOT_TOKENIZER = {"config.json", "generation_config.json", "model.safetensors"}

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2, "tie_word_embeddings": False},
    "qwen2": {"num_hidden_layers": 3, "tie_word_embeddings": True},
}


def make_tiny_model(path: Path | str, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `arch` ("llama": untied; "qwen2": tied, q/k/v biases) model to
    `path`: hidden 64, 4 heads, 2 KV heads, vocab 49152, float32. `overrides` go to the
    transformers config (e.g. rope_scaling, num_hidden_layers, tie_word_embeddings)."""
    from kvfleet.runtime.models.model_files import resolve_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"arch: must be one of {', '.join(ARCH_DEFAULTS)}, got {arch!r}")
    bundled = resolve_model("bundled")
    bundled_cfg = json.loads((bundled / "config.json").read_text())
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        # Larger than transformers' 0.02: attention is sharp rather than near-uniform, so a
        # token read from the wrong cache slot shows in the logits, and greedy picks are clear.
        "initializer_range": 0.1,
        "bos_token_id": bundled_cfg.get("bos_token_id"),
        "eos_token_id": bundled_cfg.get("eos_token_id"),
        "pad_token_id": bundled_cfg.get("pad_token_id"),
        **ARCH_DEFAULTS[arch],
        **overrides,
    }
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # transformers initialises biases to 0 and norm weights to 1, which would let a loader
    # that drops or swaps them pass unnoticed: give them random values too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for item in bundled.iterdir():
        if item.is_file() and item.name not in _NOT_TOKENIZER and item.suffix != ".safetensors":
            shutil.copy2(item, path / item.name)
    return path

"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read and
checked against the base model they are to run on.

An adapter adds `scaling * B @ A` to some of the attention and MLP projections of each layer
(q/k/v/o, gate/up/down). Everything a platform team could hand the server by mistake is
refused here with the adapter's name and the reason — a rank above --max-lora-rank, a module
the model does not have, shapes of another base model, a missing or unreadable file — so the
engine only ever holds adapters it can run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvfleet.runtime.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, by PEFT's (and transformers') module names, and where
# each lands in our fused weights: (fused projection, slice index within it).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.\w+)?\.weight$"
)
# adapter_config.json fields that change what the weights mean, with the only value we run.
_MUST_BE: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None, []),
}


class LoraError(ValueError):
    """An adapter that cannot run on this model; the message names the adapter and why."""


@dataclass(slots=True)
class LoraAdapter:
    """One adapter's weights, float32 on CPU: per (layer, module) its A [r, in] and its B
    [out, r] with the scaling already multiplied in."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (out, in) features in the whole (unsharded) model."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def read_adapter_config(name: str, folder: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json, checked for what changes the weights' meaning."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError(f"adapter {name!r}: {folder} is not a folder")
    if not path.is_file():
        raise LoraError(f"adapter {name!r}: {folder} has no {CONFIG_FILE} (not a PEFT adapter)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {kind!r} is not LORA")
    for key, allowed in _MUST_BE.items():
        if key in cfg and cfg[key] not in allowed:
            raise LoraError(
                f"adapter {name!r}: {key} {cfg[key]!r} is not supported "
                f"(only {allowed[0]!r}: plain LoRA on the projections)"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"adapter {name!r}: r must be an integer >= 1, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def load_lora_adapter(
    name: str, path: str | Path, config: ModelConfig, max_rank: int
) -> LoraAdapter:
    """Read and check the PEFT adapter in folder `path` for a model of `config`; LoraError
    saying why when it cannot run there."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = read_adapter_config(name, folder)
    rank = cfg["r"]
    if rank > max_rank:
        raise LoraError(
            f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}; start the "
            f"server with --max-lora-rank {rank} or more"
        )
    scaling = cfg.get("lora_alpha", rank) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        found = sorted(p.name for p in folder.glob("adapter_model.*"))
        raise LoraError(
            f"adapter {name!r}: {folder} has no {WEIGHTS_FILE}"
            + (f" (it has {', '.join(found)}; kvfleet reads safetensors only)" if found else "")
        )
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc}") from None
    shapes = module_shapes(config)
    base = cfg.get("base_model_name_or_path") or "another model"
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(
                f"adapter {name!r}: weight {key!r} is not a LoRA A/B of a layer projection; "
                f"kvfleet applies adapters to {', '.join(TARGETS)} only"
            )
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise LoraError(
                f"adapter {name!r}: target module {module!r} is not one this model has "
                f"(it has {', '.join(TARGETS)})"
            )
        if layer >= config.num_layers:
            raise LoraError(
                f"adapter {name!r}: {key} is for layer {layer}, but the model has "
                f"{config.num_layers} layers (trained for {base}?)"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {where} has lora_{''.join(ab)} but not both")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoraError(
                f"adapter {name!r}: {where} has lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)}, but this model needs [{rank}, {inp}] and [{out}, {rank}] "
                f"at rank {rank}: it was trained for {base}, not this base model"
            )
        a, b = a.float(), b.float() * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"adapter {name!r}: {where} holds NaN or infinite values")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    return LoraAdapter(name, str(folder), rank, weights)

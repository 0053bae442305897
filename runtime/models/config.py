"""The shape of a Llama-family model, read once from a Hugging Face config.json.

Both key styles are read: transformers 4 (`rope_theta`, `rope_scaling`) and transformers 5
(`rope_parameters` holding theta and the scaling fields together).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """config.json describes a model kvfleet cannot run; the message names the field."""


@dataclass(slots=True)
class ModelConfig:
    """Everything the model code and the KV cache need to know about a model's shape."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architectures: {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_key_value_heads: must divide num_attention_heads ({self.num_heads}), "
                f"got {self.num_kv_heads}"
            )
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope_scaling.rope_type: {rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of a config.json."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _architecture_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:  # before reading fields other models may lack
            raise ModelConfigError(
                f"architectures: {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers 5 folds theta and scaling into rope_parameters; 4.x keeps them apart.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope_params or None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.pop("rope_theta", None)
        eos = cfg.get("eos_token_id")
        eos_ids = (
            [] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
        )
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        if window and uses_window and int(window) < max_pos:
            # Within one window full attention is exact, so cap the context instead of
            # implementing sliding-window attention.
            max_pos = int(window)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no switch for them).
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """Read `folder/config.json`."""
        path = Path(folder) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"model: {folder} has no config.json") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"model: {path} is not valid JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except KeyError as e:
            raise ModelConfigError(f"model: {path}: lacks the field {e.args[0]!r}") from None
        except ModelConfigError as e:
            raise ModelConfigError(f"model: {path}: {e}") from None

    def num_parameters(self) -> int:
        """Weights in the model, counting tied input/output embeddings once (used for MFU)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        if self.attention_bias:
            qkv += (self.num_heads + 2 * self.num_kv_heads) * d
        per_layer = qkv + self.num_heads * d * h + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def step_parameters(self) -> int:
        """The weights each token's forward multiplies or reads whole: all of them but an untied
        input embedding table, of which a token reads one row (a tied table counts once, as
        the LM head). MFU counts 2 FLOPs for each; a decode step streams each once."""
        untied_input = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_parameters() - untied_input

    def inv_freq(self) -> Any:
        """RoPE inverse frequencies (float32 torch tensor, [head_dim / 2]) with scaling applied."""
        import torch

        dim = self.head_dim
        # float32 throughout, as transformers computes it, so our logits match its to rounding.
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        rope_type, s = self.rope_type, self.rope_scaling or {}
        if rope_type == "linear":
            inv = inv / float(s["factor"])
        elif rope_type == "llama3":
            inv = _llama3_scaled(inv, s)
        return inv


def _llama3_scaled(inv: Any, s: dict[str, Any]) -> Any:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short
    ones kept, and a smooth blend in between."""
    import torch

    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _architecture_from_model_type(model_type: str | None) -> str:
    by_type = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    if model_type in by_type:
        return by_type[model_type]
    raise ModelConfigError(
        f"architectures: config.json names none and model_type {model_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

"""The device and dtypes an engine runs in, from the --device, --dtype and --kv-cache-dtype
flags ("auto" resolved against the machine)."""

from __future__ import annotations

import torch
from kvfleet.kernels.cpu import cpu_features
from kvfleet.runtime.engine.config import ConfigError, EngineConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name} was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """The model's activation (and plain weight) dtype for --dtype. auto on CPU with a
    `quantized` model: float32, which its in-register kernels and fused decode step compute in
    (bf16 rows would be widened and rounded back around every projection)."""
    if name == "auto":
        if device.type == "cpu" and quantized:
            return torch.float32
        if device.type == "cuda" or cpu_features.native_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def model_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """--dtype resolved for `config`'s model on `device`, knowing whether its checkpoint is
    quantized (which resolves a Hub id, as loading it would)."""
    from kvfleet.runtime.models.loader import quantization_of

    scheme = quantization_of(
        config.model, config.quantization, config.revision, config.hf_token,
        sharded=config.tensor_parallel_size > 1,
    )  # fmt: skip
    return resolve_dtype(config.dtype, device, scheme is not None)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for --kv-cache-dtype (auto: the model's)."""
    if name == "auto":
        return model_dtype
    return torch.float8_e5m2 if name == "fp8_e5m2" else torch.float8_e4m3fn

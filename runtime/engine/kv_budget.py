"""The KV cache's byte budget on a GPU, asked once the model's weights are loaded:
--gpu-memory-utilization (vLLM's meaning) or else --kv-cache-memory-fraction."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.runtime.engine.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    import torch

GIB = 1024**3
CPU_DEFAULT_KV_MEMORY = 2 * GIB


def gpu_kv_budget(free: int, total: int, fraction: float, utilization: float | None) -> int:
    """Bytes for the KV cache on a GPU with `free` of `total` bytes free after loading.

    With a gpu_memory_utilization u the process may hold u * total in all, so the cache gets
    u * total less what is in use now (weights, CUDA context, anything else on the device);
    without one, `fraction` (kv_cache_memory_fraction) of what is free."""
    if utilization is None:
        return int(free * fraction)
    in_use = total - free
    budget = int(total * utilization) - in_use
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization: {utilization} of the GPU's {total / GIB:.1f} GiB is "
            f"{total * utilization / GIB:.1f} GiB, but {in_use / GIB:.1f} GiB are in use after "
            "loading the model, leaving nothing for the KV cache; raise "
            "--gpu-memory-utilization or serve a smaller model"
        )
    return budget


def cuda_kv_budget(device: torch.device, fraction: float, utilization: float | None) -> int:
    """gpu_kv_budget for `device`, from what CUDA reports free on it now."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(free, total, fraction, utilization)


def engine_kv_budget(config: EngineConfig, device: torch.device) -> int:
    """An engine's KV budget: --kv-cache-memory where given, else on a GPU what is left by
    gpu_kv_budget, else 2 GiB on CPU."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    if device.type == "cuda":
        return cuda_kv_budget(
            device, config.kv_cache_memory_fraction, config.gpu_memory_utilization
        )
    return CPU_DEFAULT_KV_MEMORY


def kv_blocks(
    config: EngineConfig, budget: int, per_token: int, max_model_len: int, num_blocks: int = -1
) -> int:
    """The KV blocks `budget` bytes hold at `per_token` bytes a token (or `num_blocks` where
    already known, >= 0); ConfigError where they cannot hold one sequence of max_model_len."""
    if num_blocks < 0:
        num_blocks = budget // (per_token * config.block_size)
    if num_blocks * config.block_size < max_model_len:
        raise ConfigError(
            f"kv_cache_memory: {budget} bytes hold {num_blocks * config.block_size} tokens, "
            f"fewer than max_model_len {max_model_len}; raise --kv-cache-memory or lower "
            f"--max-model-len"
        )
    return num_blocks

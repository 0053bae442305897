"""Rank 0 starting a tensor-parallel engine: resolve the model once, start the other ranks,
load its own shard beside them, agree on the KV blocks every rank can hold (the fewest any
rank can) and join the process group. The engine calls it instead of `load_model`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.model_runner import kv_bytes_per_token
from kvfleet.runtime.engine.tp_workers import (
    COLLECTIVE_TIMEOUT_S,
    TPWorkers,
    WorkerSpec,
    backend_for,
    init_process_group,
)

if TYPE_CHECKING:  # the models load lazily, as in the engine
    from kvfleet.runtime.models.config import ModelConfig
    from kvfleet.runtime.models.llama import LlamaModel

log = logging.getLogger(__name__)


def start_tensor_parallel(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    kv_budget: Callable[[], int],
    on_workers: Callable[[TPWorkers], None],
) -> tuple[LlamaModel, ModelConfig, Path | None, int]:
    """Rank 0's model shard, the model's config, its folder (None for random:*) and the KV
    blocks per rank. `kv_budget` is asked after rank 0's shard has loaded (on a GPU it is a
    share of the memory left). `on_workers` receives the workers as soon as they exist, so that a
    failure after that point can close them."""
    import torch.distributed as dist
    from kvfleet.runtime.models.loader import load_model, model_config_of
    from kvfleet.runtime.models.model_files import RANDOM_PREFIX, resolve_model
    from kvfleet.runtime.models.shard_layout import check_tensor_parallel_size, shard_layout
    from kvfleet.runtime.models.tp_group import TPGroup

    size = config.tensor_parallel_size
    if dist.is_initialized():
        raise ConfigError(
            "tensor_parallel_size: this process already runs a tensor-parallel engine; "
            "close it first (one per process)"
        )
    random_model = config.model.startswith(RANDOM_PREFIX)
    # Resolved once here (a GGUF converted, a Hub model downloaded): workers get the folder.
    folder = None if random_model else resolve_model(config.model, config.revision, config.hf_token)
    source = config.model if random_model else str(folder)
    mc = model_config_of(source)
    check_tensor_parallel_size(mc.num_heads, mc.num_kv_heads, size)
    layout = shard_layout(
        mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size, size, 0
    )
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
    )
    spec = WorkerSpec(
        model=source,
        size=size,
        device_type=device.type,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        block_size=config.block_size,
        kv_cache_memory=kv_budget() if device.type == "cpu" else config.kv_cache_memory,
        kv_cache_memory_fraction=config.kv_cache_memory_fraction,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_threads=torch.get_num_threads(),
        store_port=store.port,
        timeout_s=COLLECTIVE_TIMEOUT_S,
        seed=config.seed,
        log_level=logging.getLogger().getEffectiveLevel(),
        kernel_policy=config.kernel_policy,
    )
    workers = TPWorkers(spec)
    on_workers(workers)
    model, mc, _ = load_model(
        source, dtype, device, tp=TPGroup(layout), policy=config.kernel_policy
    )
    model.prepack()
    per_token = kv_bytes_per_token(mc, kv_dtype, layout.num_kv_heads)
    own = kv_budget() // (per_token * config.block_size)
    num_blocks = min([own, *workers.wait_loaded()])
    workers.start(num_blocks)
    init_process_group(spec, 0, store)
    log.info(
        "tensor parallel: %d ranks (%s), rank 0 holds %d of %d query heads and %d of %d "
        "KV heads; worker pids %s",
        size,
        backend_for(device.type),
        layout.num_q_heads,
        mc.num_heads,
        layout.num_kv_heads,
        mc.num_kv_heads,
        workers.pids(),
    )
    return model, mc, folder, num_blocks

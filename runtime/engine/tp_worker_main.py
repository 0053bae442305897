"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, report its KV
capacity, join the process group, then run every step rank 0 sends until told to stop.

It samples nothing and keeps no requests: its only state is its shard of the weights and of
the KV cache, which rank 0's block tables index exactly as they index rank 0's own.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from multiprocessing.connection import Connection

log = logging.getLogger("kvfleet.tp_worker")


def kv_blocks_for(
    budget: int, num_layers: int, num_kv_heads: int, head_dim: int, elem: int, block_size: int
) -> int:
    """KV blocks that `budget` bytes hold for one rank's heads."""
    return budget // (2 * num_layers * num_kv_heads * head_dim * elem * block_size)


def run_worker(rank: int, spec, conn: Connection) -> None:
    """The process's entry point (spawned by `tp_workers.TPWorkers`)."""
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s",
        stream=sys.stderr,
    )
    try:
        model, caches, device = _load(rank, spec, conn)
    except Exception as exc:  # told to rank 0, which names this rank in its own error
        log.exception("could not load the shard")
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    if model is None:  # rank 0 went away before the start
        return
    try:
        _serve_steps(model, caches, device, conn)
    except Exception:
        # A failed collective (rank 0 or a peer gone, or the timeout) or a failed forward:
        # exit non-zero; rank 0 sees the process gone and its own collective fail.
        log.exception("tensor-parallel step failed; this rank exits")
        sys.exit(1)


def _load(rank: int, spec, conn: Connection):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from kvfleet.runtime.engine.cpu_allocator import keep_freed_memory
    from kvfleet.runtime.engine.kv_budget import cuda_kv_budget
    from kvfleet.runtime.engine.model_runner import allocate_kv_caches
    from kvfleet.runtime.engine.tp_workers import init_process_group, rank_device
    from kvfleet.runtime.models.loader import load_model, model_config_of
    from kvfleet.runtime.models.shard_layout import shard_layout
    from kvfleet.runtime.models.tp_group import TPGroup

    torch.set_num_threads(spec.num_threads)
    device = torch.device(rank_device(spec.device_type, rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    torch.manual_seed(spec.seed)
    mc = model_config_of(spec.model)
    layout = shard_layout(
        mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size, spec.size, rank
    )
    tp = TPGroup(layout)
    dtype, kv_dtype = getattr(torch, spec.dtype), getattr(torch, spec.kv_dtype)
    model, mc, _ = load_model(spec.model, dtype, device, tp=tp, policy=spec.kernel_policy)
    model.prepack()
    if spec.kv_cache_memory is not None:
        budget = spec.kv_cache_memory
    else:  # only CUDA leaves it to the device, which knows what the weights left
        budget = cuda_kv_budget(device, spec.kv_cache_memory_fraction, spec.gpu_memory_utilization)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    conn.send(
        (
            "loaded",
            kv_blocks_for(
                budget, mc.num_layers, layout.num_kv_heads, mc.head_dim, elem, spec.block_size
            ),
        )
    )
    try:
        msg = conn.recv()
    except EOFError:
        return None, None, device
    if msg[0] != "start":
        return None, None, device
    num_blocks = int(msg[1])
    store = dist.TCPStore(
        "127.0.0.1",
        spec.store_port,
        spec.size,
        is_master=False,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    init_process_group(spec, rank, store)
    caches = allocate_kv_caches(
        mc, layout.num_kv_heads, num_blocks, spec.block_size, kv_dtype, device, model.kernels
    )
    log.info(
        "shard ready: %d query heads, %d KV heads, %d KV blocks",
        layout.num_q_heads,
        layout.num_kv_heads,
        num_blocks,
    )
    return model, caches, device


def _serve_steps(model, caches, device, conn: Connection) -> None:
    import torch
    import torch.distributed as dist
    from kvfleet.runtime.engine.model_runner import forward_step

    with torch.inference_mode():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0's process is gone
                break
            if msg[0] != "step":
                break
            inputs = msg[1]
            hidden = forward_step(model, caches, inputs, device)
            for rows in inputs.logit_rows:  # the same calls as rank 0: they gather logits
                model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=device)])
    dist.destroy_process_group()

"""Rank 0's side of tensor parallelism: start one worker process per other rank, agree on the
KV cache size, join the process group, send every step's inputs, notice a dead worker.

The engine (scheduler, KV cache manager, sampler) lives once, in rank 0. Each step rank 0
sends the other ranks the step's inputs over one pipe per worker (a pickled `StepInputs`, a few
KB), then every rank runs the same forward pass on its shard, meeting in torch.distributed's
all-reduces and the logits gather. Workers block on their pipe while the engine is idle (no
collective is pending, so none can time out) and leave when it closes (rank 0 gone).

Processes are started with torch.multiprocessing's spawn (a fresh interpreter: no forked
torch or CUDA state). The process group is gloo on CPU and NCCL on CUDA, with a timeout on
every collective; the NCCL path is the same code and has not been run on a GPU yet.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from kvfleet.kernels.policy import KernelPolicy

log = logging.getLogger(__name__)

# A collective waits this long for its peers before raising. A peer that dies usually shows
# sooner (its sockets close); this bounds the rest (a rank stuck, a lost connection).
COLLECTIVE_TIMEOUT_S = 60.0
# What a worker may take to start and load its shard before rank 0 gives up on it.
LOAD_TIMEOUT_S = 1800.0


# The usual reason a spawned worker dies before running any of kvfleet's code.
SPAWN_HINT = (
    "see its error above; a Python script that builds LLM(..., tensor_parallel_size=N) "
    "must do so under `if __name__ == '__main__':` (workers are spawned and import the script)"
)


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed to start, failed to load or died; the engine cannot
    run a step without it."""


def threads_per_rank(cores: int, size: int, requested: int | None) -> int:
    """CPU threads for each rank's forward pass: `requested` (--num-threads, per rank) when
    given, else the host's cores shared out so that the ranks together use each core once."""
    if requested is not None:
        return requested
    return max(1, cores // size)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def backend_for(device_type: str) -> str:
    """torch.distributed's backend for tensors on this device type."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> str:
    """The device rank `rank` runs on: its own GPU on CUDA, the CPU otherwise."""
    return f"cuda:{rank}" if device_type == "cuda" else "cpu"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its shard and join the group (pickled to it)."""

    model: str  # a resolved folder, or random:<name>
    size: int
    device_type: str  # "cpu" or "cuda"
    dtype: str  # torch dtype name, e.g. "float32"
    kv_dtype: str
    block_size: int
    kv_cache_memory: int | None  # bytes per rank; None: the device default
    kv_cache_memory_fraction: float
    gpu_memory_utilization: float | None  # vLLM's meaning (kv_budget.py); None: the fraction
    num_threads: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    timeout_s: float
    seed: int
    log_level: int
    kernel_policy: KernelPolicy  # rank 0's: every rank runs the same kernels


def init_process_group(spec: WorkerSpec, rank: int, store: Any) -> None:
    """Join the tensor-parallel group (every rank calls it; it returns when all have)."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if spec.device_type == "cuda":
        import torch

        kwargs["device_id"] = torch.device(rank_device("cuda", rank))
    dist.init_process_group(
        backend_for(spec.device_type),
        store=store,
        rank=rank,
        world_size=spec.size,
        timeout=timedelta(seconds=spec.timeout_s),
        **kwargs,
    )


class TPWorkers:
    """The worker processes of ranks 1..size-1, started by the constructor."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch.multiprocessing as mp
        from kvfleet.runtime.engine.tp_worker_main import run_worker

        self.spec = spec
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(1, spec.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(rank, spec, child),
                name=f"kvfleet-tp-rank{rank}",
                daemon=True,  # never outlives rank 0's process
            )
            proc.start()
            child.close()
            log.info("tensor-parallel rank %d started (pid %d)", rank, proc.pid)
            self.procs.append(proc)
            self.conns.append(parent)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_loaded(self, timeout_s: float = LOAD_TIMEOUT_S) -> list[int]:
        """Each worker's KV-cache capacity in blocks, once all have loaded their shards;
        TPWorkerError with the worker's own message if one fails or dies first."""
        blocks: dict[int, int] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = [self.procs[i].sentinel for i in pending]
            ready = wait([*pending.values(), *sentinels], timeout=timeout_s)
            if not ready:
                raise TPWorkerError(
                    f"tensor-parallel ranks {[i + 1 for i in pending]} did not load their "
                    f"shards within {timeout_s:.0f} s"
                )
            for i, conn in list(pending.items()):
                if conn in ready:
                    try:
                        msg = self._recv(i)
                    except TPWorkerError as exc:  # gone without a word: it never ran our code
                        raise TPWorkerError(
                            f"{exc} before loading its shard; {SPAWN_HINT}"
                        ) from None
                    if msg[0] == "error":
                        raise TPWorkerError(f"tensor-parallel rank {i + 1}: {msg[1]}")
                    blocks[i] = int(msg[1])
                    del pending[i]
            for i in pending:
                why = self._death(i)
                if why is not None:  # died before it could even report an error
                    raise TPWorkerError(f"{why} before loading its shard; {SPAWN_HINT}")
        return [blocks[i] for i in range(len(self.conns))]

    def start(self, num_blocks: int) -> None:
        """Tell every worker the agreed number of KV blocks; they then join the group."""
        for conn in self.conns:
            conn.send(("start", num_blocks))

    def send_step(self, inputs: Any) -> None:
        """Hand every worker this step's inputs (rank 0 then runs its own shard)."""
        self.check_alive()
        for i, conn in enumerate(self.conns):
            try:
                conn.send(("step", inputs))
            except OSError as exc:
                raise TPWorkerError(self._death(i) or f"rank {i + 1}: {exc}") from None

    def check_alive(self) -> None:
        """TPWorkerError naming the first worker that has exited."""
        for i in range(len(self.procs)):
            why = self._death(i)
            if why is not None:
                raise TPWorkerError(why)

    def _death(self, i: int) -> str | None:
        code = self.procs[i].exitcode
        if code is None:
            return None
        return f"tensor-parallel rank {i + 1} (pid {self.procs[i].pid}) exited with code {code}"

    def _recv(self, i: int) -> tuple[Any, ...]:
        try:
            return self.conns[i].recv()
        except (EOFError, OSError):
            raise TPWorkerError(
                self._death(i) or f"tensor-parallel rank {i + 1} closed its pipe"
            ) from None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to leave, wait a while, then stop the ones that did not."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()

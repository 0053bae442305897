"""The server's side of the engine core: start its process, send it work, read its steps, and
know at once when it dies.

Transport: two ZeroMQ sockets over IPC (PUSH to the core, PULL from it) carrying msgspec
MessagePack (core_messages.py) — what vLLM's split uses, for the same reasons: ZeroMQ queues
and batches messages on its own I/O thread, so neither side ever blocks on the other, and
msgspec decodes straight into typed structs. The process's sentinel is watched on the event
loop: a core killed with SIGKILL is noticed within milliseconds, not at the next timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.core_messages import (
    CoreDied,
    CoreInfo,
    EngineStats,
    FromCore,
    LoadFailed,
    Ready,
    Shutdown,
    StepOutputs,
    ToCore,
)
from kvfleet.runtime.engine.core_process import run_core_process

log = logging.getLogger(__name__)

# How long a stopping core gets to leave on its own before it is killed.
STOP_TIMEOUT_S = 30.0


class CoreLoadError(RuntimeError):
    """The core process could not load the model (its message says why)."""


class CoreClient:
    """One engine core process and the two sockets to it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._folder = Path(tempfile.mkdtemp(prefix="kvfleet-core-"))
        self._context = zmq.asyncio.Context(1)
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._death_reported = False

    async def start(self) -> tuple[CoreInfo, EngineStats]:
        """Start the core process and wait until it has loaded the model and passed its
        warm-up; raise CoreLoadError if it could not."""
        inputs, outputs = f"ipc://{self._folder}/in", f"ipc://{self._folder}/out"
        self._to_core.bind(inputs)
        self._from_core.bind(outputs)
        # spawn, not fork: a forked child would inherit the server's threads (aiohttp's
        # executor, zmq's I/O thread) in whatever state they were in.
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(
            target=run_core_process,
            args=(self.config, inputs, outputs, logging.getLogger().getEffectiveLevel()),
            name="kvfleet-engine-core",
            # Not a daemon: it starts tensor-parallel workers of its own. It dies with this
            # process all the same (core_process.die_with_parent).
            daemon=False,
        )
        self._process.start()
        received = asyncio.ensure_future(self._from_core.recv())
        exited = asyncio.ensure_future(self._exited())
        try:
            await asyncio.wait({received, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled too (a signal while loading): no receive is left pending
            exited.cancel()
            if not received.done():
                received.cancel()
        if received.cancelled():
            raise CoreLoadError(f"the engine core exited with code {self._process.exitcode}")
        message = self._decoder.decode(received.result())
        if isinstance(message, LoadFailed):
            await self._reap()
            raise CoreLoadError(message.message)
        assert isinstance(message, Ready), message
        return message.info, message.stats

    def send(self, message: ToCore) -> None:
        """Queue a message for the core (never blocks: ZeroMQ's thread sends it)."""
        self._to_core.send(self._encoder.encode(message), copy=False)

    async def run(
        self, on_step: Callable[[StepOutputs], None], on_death: Callable[[str], None]
    ) -> None:
        """Hand each step's outputs to `on_step` until the core dies (then `on_death` once,
        with why) or this task is cancelled."""
        exited = asyncio.ensure_future(self._exited())
        try:
            while True:
                received = asyncio.ensure_future(self._from_core.recv())
                await asyncio.wait({received, exited}, return_when=asyncio.FIRST_COMPLETED)
                if not received.done():
                    received.cancel()
                    self._report_death(on_death, self._exit_message())
                    return
                message = self._decoder.decode(received.result())
                if isinstance(message, StepOutputs):
                    on_step(message)
                elif isinstance(message, CoreDied):
                    self._report_death(on_death, message.message)
                    return
        finally:
            exited.cancel()

    def _report_death(self, on_death: Callable[[str], None], why: str) -> None:
        if not self._death_reported:
            self._death_reported = True
            log.error("the engine core stopped: %s", why)
            on_death(why)

    def _exit_message(self) -> str:
        assert self._process is not None
        code = self._process.exitcode
        if code is not None and code < 0:
            return f"the engine core process was killed by signal {-code}"
        return f"the engine core process exited with code {code}"

    async def _exited(self) -> None:
        """Return once the core process has exited (its sentinel becomes readable)."""
        assert self._process is not None
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        sentinel = self._process.sentinel
        loop.add_reader(sentinel, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(sentinel)
        # The kernel closes a dying process's files before its exit status can be reaped:
        # wait the moment between, so that the exit code (a signal's number) is known.
        await asyncio.to_thread(self._process.join, 1)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Tell the core to stop, wait for it (killing it after `timeout` seconds; 0: at
        once, as for a core still loading, which reads no messages) and clean up."""
        if self.alive and timeout > 0:
            self.send(Shutdown())
        await self._reap(timeout)

    async def _reap(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process = self._process
        if process is not None and process.is_alive():
            try:
                await asyncio.wait_for(self._exited(), timeout)
            except TimeoutError:
                if timeout:
                    log.warning("the engine core did not stop within %.0f s: killed", timeout)
                process.kill()
                await asyncio.to_thread(process.join, 5)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        with contextlib.suppress(OSError):
            shutil.rmtree(self._folder)

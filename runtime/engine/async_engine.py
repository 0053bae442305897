"""AsyncEngine: the server process's face of the engine — input processor, engine core in its
own process, output processor — with one `generate` per API request.

The event loop never waits on a forward pass and the core never waits on the event loop:
requests go to the core as messages, each step's new tokens come back as one message, and the
output processor turns them into text deltas here, while the core runs the next step. A core
that dies (crash, SIGKILL, a dead tensor-parallel rank) ends every open stream with an error at
once and sets `crashed`, so that `kvfleet serve` exits and the pod restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.engine.core_messages import (
    AbortRequests,
    AddLora,
    AddRequests,
    CoreInfo,
    CoreRequest,
    EngineStats,
    RemoveLora,
    StepOutputs,
)
from kvfleet.runtime.engine.input_processor import InputProcessor
from kvfleet.runtime.engine.output_processor import OutputProcessor, RequestDelta
from kvfleet.runtime.engine.structured_outputs import warm_grammar_engine

if TYPE_CHECKING:
    from kvfleet.runtime.engine.config import EngineConfig
    from kvfleet.runtime.engine.core_client import CoreClient
    from kvfleet.runtime.engine.output_processor import SequenceObserver

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped (crash or shutdown); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine gave up on this one request (it goes on serving the others)."""


class AsyncEngine:
    """Build it, `await start()`, then `generate(...)` per API request."""

    def __init__(self, config: EngineConfig, observer: SequenceObserver | None = None) -> None:
        self.config = config
        self._observer = observer
        self.info: CoreInfo | None = None
        self.inputs: InputProcessor | None = None  # once loaded: tokenize, render, validate
        self.stats = EngineStats()
        self._client: CoreClient | None = None
        self._outputs: OutputProcessor | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._groups: dict[str, list[str]] = {}  # API request id → its prompts' group ids
        self._sent = 0  # sequences sent to the core, ever (stats.received: taken in)
        self._error: str | None = None
        self._lora_loads: dict[int, asyncio.Future[str]] = {}  # AddLora sent, not answered
        self._stopping = False
        # Set once the core has died: the server then exits so that the process is restarted
        # instead of answering 503 for ever.
        self.crashed = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the core process and load the tokenizer; return once the core has passed its
        warm-up generation. Re-raises a load error."""
        from kvfleet.runtime.engine.core_client import STOP_TIMEOUT_S, CoreClient
        from kvfleet.runtime.engine.engine_tokenizer import (
            load_engine_tokenizer,
            tokenizer_known_ahead,
        )

        # The core first, before anything here imports torch: its load then runs beside this
        # process's imports rather than after them.
        self._client = CoreClient(self.config)
        core = asyncio.ensure_future(self._client.start())
        # While the core process loads the model (on the other cores): the tokenizer where its
        # folder is known (a wrong --tokenizer then stops the load), else its code; then the
        # grammar engine (a first structured-output request would otherwise import it on the
        # event loop). One thread: transformers' lazy imports are not thread-safe.
        ahead = tokenizer_known_ahead(self.config)
        preloads = asyncio.ensure_future(asyncio.to_thread(_preload, self.config, ahead))
        try:
            tokenizer = await preloads if ahead else None
            self.info, self.stats = await core
            if tokenizer is None:
                await preloads
                tokenizer = await asyncio.to_thread(
                    load_engine_tokenizer, self.config, self.info.model_folder
                )
        except BaseException as exc:
            # Cancelled (a signal while loading) or failed: a core still loading reads no
            # messages, so it is not asked to stop but killed.
            loading = isinstance(exc, asyncio.CancelledError) or self.info is None
            core.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await core  # its error, if it is what failed, is `exc`
            preloads.cancel()  # its threads end on their own; nobody waits for them
            await self._client.stop(timeout=0 if loading else STOP_TIMEOUT_S)
            self._client = None
            raise
        self.inputs = InputProcessor(tokenizer, self.info)
        self._outputs = OutputProcessor(tokenizer, self._observer, self.config.stream_interval)
        self._reader = asyncio.create_task(self._client.run(self._on_step, self._on_death))

    async def stop(self) -> None:
        """End what is left and stop the core process."""
        self._stopping = True
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._client is not None:
            await self._client.stop()

    @property
    def is_alive(self) -> bool:
        return self._client is not None and self._error is None and self._client.alive

    @property
    def num_in_flight(self) -> int:
        """API requests submitted here and not yet finished."""
        return len(self._queues)

    @property
    def num_pending(self) -> int:
        """Sequences waiting for admission: on their way to the core or in its waiting queue
        (a request with n completions counts n, as the core queues n sequences for it)."""
        return max(self._sent - self.stats.received, 0) + self.stats.num_waiting

    # --- requests ----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompts: list[list[CoreRequest]]
    ) -> AsyncIterator[RequestDelta]:
        """Run a request's prompts (each as the input processor's sequences, group ids unique)
        and yield their deltas until every prompt has finished. Leaving the loop early (client
        gone, handler cancelled) aborts what still runs, which frees its KV blocks at once."""
        if self._error is not None or self._stopping or self._client is None:
            raise EngineDeadError(self._error or "the engine is not running")
        assert self._outputs is not None
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        groups = [seqs[0].group_id for seqs in prompts]
        try:
            for index, seqs in enumerate(prompts):
                self._outputs.add(index, seqs, queue.put_nowait)
        except BaseException:
            self._abort(groups)  # nothing was sent: forget what was added
            raise
        self._queues[request_id] = queue
        self._groups[request_id] = groups
        sequences = [r for seqs in prompts for r in seqs]
        self._client.send(AddRequests(sequences))
        self._sent += len(sequences)
        remaining = len(prompts)
        try:
            while remaining:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.error is not None:
                    raise RequestFailedError(delta.error)
                remaining -= delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            self._abort(self._groups.pop(request_id, []))

    # --- LoRA adapters -------------------------------------------------------------------------
    async def add_lora(self, lora_id: int, name: str, path: str) -> None:
        """Have the core load adapter `name` from local PEFT folder `path` as `lora_id`;
        raise LoraError with the core's reason when it refuses it."""
        from kvfleet.runtime.models.lora import LoraError

        if self._error is not None or self._stopping or self._client is None:
            raise EngineDeadError(self._error or "the engine is not running")
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._lora_loads[lora_id] = answer
        self._client.send(AddLora(lora_id, name, path))
        try:
            why = await answer
        finally:
            self._lora_loads.pop(lora_id, None)
        if why:
            raise LoraError(why)

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter (sequences running it finish first)."""
        if self._client is not None and self._error is None:
            self._client.send(RemoveLora(lora_id))

    def _abort(self, groups: list[str]) -> None:
        if self._outputs is None or self._client is None:
            return
        now = time.monotonic()
        running = [rid for g in groups for rid in self._outputs.abort(g, now)]
        if running and self._error is None:
            self._client.send(AbortRequests(running))

    # --- from the core -----------------------------------------------------------------------
    def _on_step(self, step: StepOutputs) -> None:
        assert self._outputs is not None and self._client is not None
        self.stats = step.stats
        for lora_id, why in step.loras:
            answer = self._lora_loads.get(lora_id)
            if answer is not None and not answer.done():
                answer.set_result(why)
        for request_id, why in step.refused:
            self._outputs.fail(request_id.partition("#")[0], why, step.now)
        for reason, ids in self._outputs.process(step.outputs, step.now).items():
            self._client.send(AbortRequests(ids, reason))

    def _on_death(self, why: str) -> None:
        self._error = why
        if not self._stopping:
            self._fail_all(EngineDeadError(why))
            self.crashed.set()

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        for answer in self._lora_loads.values():
            if not answer.done():
                answer.set_exception(exc)


def _preload(config: EngineConfig, load_tokenizer: bool) -> Any:
    """The tokenizer if `load_tokenizer`, else None with its code imported; then the grammar
    engine imported."""
    from kvfleet.runtime.engine.engine_tokenizer import (
        load_engine_tokenizer,
        preload_tokenizer_code,
    )

    tokenizer = None
    if load_tokenizer:
        tokenizer = load_engine_tokenizer(config, None)
    else:
        preload_tokenizer_code(config)
    warm_grammar_engine()
    return tokenizer

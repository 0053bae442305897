"""AsyncEngine: the single-threaded LLMEngine in its own thread, with an asyncio face.

The engine thread is the only caller of the engine: it applies queued adds and aborts between
steps, runs one forward pass per step and hands each step's outputs to the event loop in one
`call_soon_threadsafe`. HTTP handlers never wait on a forward pass; they await per-request
queues. When there is nothing to do the thread sleeps on a condition (no busy loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.runtime.engine.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import EngineObserver, LLMEngine
    from kvfleet.runtime.engine.request import RequestOutput
    from kvfleet.runtime.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# How often an idle engine thread checks the engine's health (a tensor-parallel worker that
# died while no step ran): /health turns 503 and `kvfleet serve` exits within about this.
HEALTH_POLL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crash or shutdown); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine gave up on this one request (it goes on serving the others)."""


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A consistent snapshot of the engine's gauges and counters, published by the engine
    thread after every step so that /metrics never reads engine state from another thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Owns the engine thread. Build it, `await start()`, then `generate(...)` per request."""

    def __init__(
        self,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        engine_factory: Callable[[EngineConfig, EngineObserver | None], LLMEngine] | None = None,
    ) -> None:
        self.config = config
        self._observer = observer
        self._factory = engine_factory
        self.engine: LLMEngine | None = None
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        # Set on the event loop once the engine thread has crashed: the server then exits so
        # that the pod restarts instead of answering 503 for ever.
        self.crashed = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model in the engine thread (so torch's thread state belongs to it) and
        return once it is ready; re-raises a load error."""
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()
        await self._loaded

    async def stop(self) -> None:
        """Abort what is left, stop the thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def num_in_flight(self) -> int:
        """Requests submitted here and not yet finished (queued, waiting or running)."""
        return len(self._queues)

    @property
    def num_pending(self) -> int:
        """Sequences waiting for admission, still in the inbox or in the engine's waiting queue
        (a request with n completions counts n, as the engine queues n sequences for it)."""
        with self._cond:
            inbox = sum(item.params.n for item in self._adds)
        return inbox + self.stats.num_waiting

    # --- requests ----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. Leaving the loop early
        (client gone, handler cancelled) aborts it, which frees its KV blocks at once."""
        if self._error is not None or self._stopping:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        item = _Add(request_id, prompt_token_ids, params, time.monotonic(), queue)
        with self._cond:
            self._adds.append(item)
            self._cond.notify()
        finished = False
        try:
            while True:
                out = await queue.get()
                # Outputs are cumulative: when the handler fell behind, only the newest matters.
                while not isinstance(out, BaseException) and not out.finished and not queue.empty():
                    out = queue.get_nowait()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                if out.error is not None:
                    finished = True
                    raise RequestFailedError(out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to drop a request (a no-op once it has finished)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._factory is not None:
                self.engine = self._factory(self.config, self._observer)
            else:
                from kvfleet.runtime.engine.llm_engine import LLMEngine

                self.engine = LLMEngine(self.config, observer=self._observer)
            # Loaded means able to generate: a short warm-up generation proves it.
            self.engine.warm_up()
        except BaseException as exc:
            self._error = exc
            self._close_engine()
            self._call_loop(self._set_loaded, exc)
            return
        self._publish_stats()
        self._call_loop(self._set_loaded, None)
        try:
            self._loop_forever()
        except BaseException as exc:
            log.exception("engine thread crashed")
            self._error = exc
            self._call_loop(self._fail_all, EngineDeadError(f"engine failed: {exc}"))
            self._call_loop(self.crashed.set)
            self._close_engine()
            return
        self._call_loop(self._fail_all, EngineDeadError("the server is shutting down"))
        self._close_engine()

    def _close_engine(self) -> None:
        """Stop the engine's worker processes, if it has any (tensor parallelism)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("closing the engine failed")

    def _loop_forever(self) -> None:
        engine = self.engine
        assert engine is not None
        live: set[str] = set()  # request ids the engine holds, to abort them on shutdown
        while True:
            with self._cond:
                while (
                    not self._adds
                    and not self._aborts
                    and not self._stopping
                    and not engine.has_unfinished_requests()
                ):
                    self._cond.wait(HEALTH_POLL_S)
                    engine.check_health()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            for item in adds:
                try:
                    engine.add_request(
                        item.request_id, item.prompt_token_ids, item.params, item.arrival_time
                    )
                    live.add(item.request_id)
                except Exception as exc:  # a bad request must not take the engine down
                    self._call_loop(_put, item.queue, exc)
            for rid in aborts:
                engine.abort_request(rid)
                live.discard(rid)
            if stopping:
                for rid in live:
                    engine.abort_request(rid)
                self._publish_stats()
                return
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self._publish_stats()
            if outputs:
                for out in outputs:
                    if out.finished:
                        live.discard(out.request_id)
                self._call_loop(self._deliver, outputs)

    def _publish_stats(self) -> None:
        e = self.engine
        assert e is not None
        self.stats = EngineStats(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_cache_usage=e.kv.usage,
            prompt_tokens=e.counters.prompt_tokens,
            generation_tokens=e.counters.generation_tokens,
            finished=dict(e.counters.finished),
            num_preemptions=e.scheduler.num_preemptions,
            prefix_cache_queries=e.kv.stats.queries,
            prefix_cache_hits=e.kv.stats.hits,
        )

    def _call_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # The loop may close between the check and the call (shutdown): nothing to tell then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    # --- on the event loop -------------------------------------------------------------------
    def _set_loaded(self, exc: BaseException | None) -> None:
        assert self._loaded is not None
        if self._loaded.done():
            return
        if exc is None:
            self._loaded.set_result(None)
        else:
            self._loaded.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)


def _put(queue: asyncio.Queue[Any], item: Any) -> None:
    queue.put_nowait(item)

"""The autoscaler's tasks: one asyncio task per autoscaled InferenceService, started and stopped
from the object's watch events through kopf's public API, and no finalizer.

Why not a `@kopf.daemon`: kopf gives every daemon's object a finalizer (so that it can stop the
daemon before the object goes) and offers no option against it; its maintainer declined one
(nolar/kopf#896), naming the older pattern instead: start a task from a handler, stop it on
deletion. A finalizer would leave every autoscaled InferenceService stuck in Terminating once
the operator is uninstalled (tests/operator/test_finalizers.py).

So a `@kopf.on.event` handler sees every watch event of every InferenceService, the initial
listing included (a restarted operator resumes its loops), and brings `AutoscalerTasks` in line
with the latest one: a loop (autoscale_loop.py) runs per uid while `spec.autoscaling.enabled`
is true and the object is not being deleted; a DELETED event, a deletionTimestamp or autoscaling
turned off stop it, and `@kopf.on.cleanup` stops them all when the operator exits. A stopped
loop finishes its current poll, or is cancelled after STOP_TIMEOUT_SECONDS; a loop that raised
is logged and started again after RESTART_BACKOFF_SECONDS, with a fresh state.

Only the leader acts: of several operator replicas only the Lease holder runs kopf at all
(cmd_operator.py, leader_election.py), so only it gets these events; the tasks live in kopf's
event loop and end with it (a replica that loses the Lease exits at once).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kopf
from kvfleet.operator.autoscale_loop import WatchedObject, pause, poll_until_stopped
from kvfleet.operator.kube_api import ISVCS

if TYPE_CHECKING:
    from kvfleet.operator.handlers import OperatorConfig

log = logging.getLogger("kvfleet.autoscaler")

RESTART_BACKOFF_SECONDS = 5.0  # after a loop raised, as kopf's daemon backoff was
STOP_TIMEOUT_SECONDS = 10.0  # a stopped loop's last poll may take this long, then is cancelled


def autoscaling_enabled(body: Mapping[str, Any]) -> bool:
    """Whether this InferenceService should have a loop: `spec.autoscaling.enabled` is true and
    the object is not being deleted."""
    auto = (body.get("spec") or {}).get("autoscaling")
    deleting = (body.get("metadata") or {}).get("deletionTimestamp")
    return isinstance(auto, Mapping) and auto.get("enabled") is True and not deleting


@dataclass(slots=True)
class _Loop:
    watched: WatchedObject
    task: asyncio.Task[None]


class AutoscalerTasks:
    """The autoscaler loops of one operator run, by InferenceService uid.

    Its methods run in kopf's event loop (async handlers), one at a time between awaits, so the
    bookkeeping needs no lock.
    """

    def __init__(
        self,
        run_loop: Callable[[WatchedObject], Awaitable[None]],
        *,
        restart_backoff: float = RESTART_BACKOFF_SECONDS,
        stop_timeout: float = STOP_TIMEOUT_SECONDS,
    ) -> None:
        self._run_loop = run_loop
        self._restart_backoff = restart_backoff
        self._stop_timeout = stop_timeout
        self._running: dict[str, _Loop] = {}
        # Per uid, the last loop told to stop: a new loop of that object waits for it to end.
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # every unfinished loop, for shutdown

    def running(self) -> frozenset[str]:
        """The uids whose loop runs and has not been told to stop."""
        return frozenset(self._running)

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Bring the loops in line with one watch event (type None: the initial listing)."""
        uid = (body.get("metadata") or {}).get("uid")
        if not uid:
            return
        loop = self._running.get(uid)
        if event_type != "DELETED" and autoscaling_enabled(body):
            # A copy: the loop reads it across awaits, whatever kopf does with its own.
            latest = copy.deepcopy(dict(body))
            if loop is None:
                self._start(uid, latest)
            else:
                loop.watched.body = latest
        elif loop is not None:
            self._stop(uid)

    async def stop_all(self) -> None:
        """Stop every loop (the operator exits): current polls may finish within the stop
        timeout, then what still runs is cancelled."""
        for uid in list(self._running):
            self._stop(uid)
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=self._stop_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _start(self, uid: str, body: dict[str, Any]) -> None:
        watched = WatchedObject(body)
        task = asyncio.create_task(
            self._supervise(watched, self._stopping.get(uid)),
            name=f"autoscaler {watched.namespaced_name}",
        )
        self._running[uid] = _Loop(watched, task)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, uid))

    def _stop(self, uid: str) -> None:
        loop = self._running.pop(uid)
        loop.watched.stop.set()
        self._stopping[uid] = loop.task
        # A no-op when the loop has ended by then.
        asyncio.get_running_loop().call_later(self._stop_timeout, loop.task.cancel)

    def _finished(self, uid: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        loop = self._running.get(uid)
        if loop is not None and loop.task is task:  # it ended itself: its object is gone
            del self._running[uid]
        if self._stopping.get(uid) is task:
            del self._stopping[uid]

    async def _supervise(self, watched: WatchedObject, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            # The object's former loop may be finishing a poll: never two polls of one object.
            await asyncio.wait({previous})
        while not watched.stop.is_set():
            try:
                await self._run_loop(watched)
                return
            except Exception:
                # Never out of this task: kopf re-raises its tasks' errors when it exits.
                log.exception(
                    "%s: the autoscaler's loop failed; starting it again in %g s",
                    watched.namespaced_name,
                    self._restart_backoff,
                )
                await pause(watched.stop, self._restart_backoff)


def register_autoscaler(registry: kopf.OperatorRegistry, config: OperatorConfig) -> AutoscalerTasks:
    """Add the autoscaler's handlers to the operator's registry (handlers.build_registry calls
    this); the returned tasks belong to this registry alone. See autoscale_loop.py for the
    settings in `config.extra`."""
    tasks = AutoscalerTasks(functools.partial(poll_until_stopped, config))

    # Async, so that kopf runs it in its event loop (the tasks' loop), not in a worker thread.
    @kopf.on.event(*ISVCS, registry=registry)
    async def autoscaler_tasks(type: str | None, body: kopf.Body, **_: Any) -> None:
        tasks.observe(type, body)

    @kopf.on.cleanup(registry=registry)
    async def stop_autoscalers(**_: Any) -> None:
        await tasks.stop_all()

    return tasks

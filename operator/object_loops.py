"""One asyncio loop per InferenceService that wants one, started and stopped from the object's
watch events: the autoscaler's (autoscale_tasks.py) and the LoRA adapters' (lora_tasks.py).

Why not `@kopf.daemon`: kopf gives every daemon's object a finalizer and offers no option
against it (autoscale_tasks.py says more); so a `@kopf.on.event` handler hands every watch event
of every InferenceService, the initial listing included, to `ObjectLoops.observe`, which brings
the loops in line with it: a loop runs per uid while `wanted(body)` holds and the object is not
being deleted; a DELETED event, a deletionTimestamp or `wanted` turning false stop it. A stopped
loop finishes its current pass, or is cancelled after STOP_TIMEOUT_SECONDS; a loop that raised
is logged and started again after RESTART_BACKOFF_SECONDS.

Each loop reads the latest copy of its object from `WatchedObject.body`; `wake` is set when the
spec changed (a new generation) or `wake_up` is called (a pod of the object changed), for loops
that act on such news at once rather than at their next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.kube_api import ISVCS, KubeApi, KubeApiError

RESTART_BACKOFF_SECONDS = 5.0  # after a loop raised, as kopf's daemon backoff was
STOP_TIMEOUT_SECONDS = 10.0  # a stopped loop's last pass may take this long, then is cancelled


@dataclass(slots=True)
class WatchedObject:
    """One InferenceService as its latest watch event showed it, and the requests to its loop:
    `stop` (end) and `wake` (look again now). `body` is replaced by each event, never changed in
    place: a pass reads one version."""

    body: Mapping[str, Any]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def namespaced_name(self) -> str:
        """namespace/name, for logs."""
        meta = self.body["metadata"]
        return f"{meta['namespace']}/{meta['name']}"


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep for `seconds`, or until `stop` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


@dataclass(slots=True)
class _Loop:
    watched: WatchedObject
    task: asyncio.Task[None]


class ObjectLoops:
    """The loops of one kind (`label`, logged to `log`) of one operator run, by uid.

    Its methods run in kopf's event loop (async handlers), one at a time between awaits, so the
    bookkeeping needs no lock.
    """

    def __init__(
        self,
        run_loop: Callable[[WatchedObject], Awaitable[None]],
        wanted: Callable[[Mapping[str, Any]], bool],
        *,
        label: str,
        log: logging.Logger,
        restart_backoff: float = RESTART_BACKOFF_SECONDS,
        stop_timeout: float = STOP_TIMEOUT_SECONDS,
    ) -> None:
        self._run_loop = run_loop
        self._wanted = wanted
        self._label = label
        self._log = log
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
        meta = body.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        loop = self._running.get(uid)
        deleting = meta.get("deletionTimestamp")
        if event_type != "DELETED" and not deleting and self._wanted(body):
            # A copy: the loop reads it across awaits, whatever kopf does with its own.
            latest = copy.deepcopy(dict(body))
            if loop is None:
                self._start(uid, latest)
            else:
                before = loop.watched.body.get("metadata", {}).get("generation")
                loop.watched.body = latest
                if meta.get("generation") != before:
                    loop.watched.wake.set()
        elif loop is not None:
            self._stop(uid)

    def wake_up(self, namespace: str, name: str) -> None:
        """Ask the loop of InferenceService namespace/name, if it has one, to look again now."""
        for loop in self._running.values():
            meta = loop.watched.body["metadata"]
            if (meta.get("namespace"), meta.get("name")) == (namespace, name):
                loop.watched.wake.set()

    async def stop_all(self) -> None:
        """Stop every loop (the operator exits): current passes may finish within the stop
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
            name=f"{self._label} {watched.namespaced_name}",
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
            # The object's former loop may be finishing a pass: never two passes of one object.
            await asyncio.wait({previous})
        while not watched.stop.is_set():
            try:
                await self._run_loop(watched)
                return
            except Exception:
                # Never out of this task: kopf re-raises its tasks' errors when it exits.
                self._log.exception(
                    "%s: the %s's loop failed; starting it again in %g s",
                    watched.namespaced_name,
                    self._label,
                    self._restart_backoff,
                )
                await pause(watched.stop, self._restart_backoff)


def gone(api: KubeApi, body: Mapping[str, Any]) -> bool:
    """Whether a loop's InferenceService was deleted (or deleted and created again)."""
    meta = body["metadata"]
    try:
        live = api.get(ISVCS, meta["namespace"], meta["name"])
    except KubeApiError:
        return False  # cannot tell: go on as usual; the next pass meets the API problem
    if live is None:
        return True
    live_meta = live.get("metadata") or {}
    return live_meta.get("uid") != meta.get("uid") or bool(live_meta.get("deletionTimestamp"))

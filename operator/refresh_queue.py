"""Children's events become reconciles of their owner through a work queue, as in
controller-runtime.

kopf runs an event handler once: if it raises, the error is logged and the event is gone (kopf
retries only create/update/resume handlers). A child's event is often the only news that an
InferenceService became Ready, so a status write that failed there (a 500, a timeout, a conflict
that kept coming) left its status stale until some unrelated event happened, and a
`kubectl wait --for=condition=Ready` waited for nothing. Here each event adds its owner's key;
`workers` threads reconcile the keys that are due, never one key in two threads at once, and a
key whose reconcile fails is added again after a delay that doubles from `base_delay` to
`max_delay` (reset by a success). A key already waiting is not added twice, so a burst of
events for one owner (a rollout changes every pod several times) costs one reconcile, not one
per event. An event that comes while its key is being reconciled adds it again, to run once
that reconcile ends: it may have read the child before the change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name) of the InferenceService


class RefreshQueue:
    """Owner keys waiting for `work(namespace, name)`, run by `workers` threads."""

    def __init__(
        self,
        work: Callable[[str, str], None],
        base_delay: float = 0.5,
        max_delay: float = 60.0,
        workers: int = 4,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self._work = work
        self.base_delay, self.max_delay, self.workers = base_delay, max_delay, workers
        self._due: dict[Key, float] = {}  # key -> monotonic time it may run
        self._failures: dict[Key, int] = {}
        self._running: set[Key] = set()  # keys a worker is reconciling
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def add(self, namespace: str, name: str, delay: float = 0.0) -> None:
        """Reconcile this owner `delay` seconds from now, or sooner if it already waits."""
        key, due = (namespace, name), time.monotonic() + delay
        with self._cond:
            if key not in self._due or due < self._due[key]:
                self._due[key] = due
                self._cond.notify()

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted owner: nothing left to reconcile, no retry to schedule."""
        with self._cond:
            self._due.pop((namespace, name), None)
            self._failures.pop((namespace, name), None)

    def waiting(self) -> dict[Key, float]:
        """Keys waiting and the seconds until each may run (negative: overdue)."""
        now = time.monotonic()
        with self._cond:
            return {key: due - now for key, due in self._due.items()}

    def start(self) -> None:
        """Start the workers (once; a stopped queue stays stopped)."""
        with self._cond:
            if self._threads or self._stopping:
                return
            for i in range(self.workers):
                thread = threading.Thread(
                    target=self._run, name=f"kvfleet-refresh-queue-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking keys; wait for reconciles under way to end. Keys left are dropped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _next(self) -> Key | None:
        """The key due first that no worker is running, once it is due; None when stopping."""
        with self._cond:
            while not self._stopping:
                ready = [(due, key) for key, due in self._due.items() if key not in self._running]
                if not ready:
                    self._cond.wait()
                    continue
                due, key = min(ready)
                wait = due - time.monotonic()
                if wait <= 0:
                    del self._due[key]
                    self._running.add(key)
                    return key
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        while (key := self._next()) is not None:
            try:
                self._work(*key)
            except Exception as exc:  # any failure is retried: none is lost
                with self._cond:
                    failures = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(self.base_delay * 2 ** (failures - 1), self.max_delay)
                log.warning(
                    "reconciling %s/%s after a child's change failed (%s); again in %.1f s",
                    *key, exc, delay,
                )  # fmt: skip
                self.add(*key, delay=delay)
            else:
                with self._cond:
                    self._failures.pop(key, None)
            finally:
                with self._cond:  # a re-added key may run now
                    self._running.discard(key)
                    self._cond.notify_all()

"""Children's events reach their owner's reconcile through operator/refresh_queue.py: one
reconcile per burst of events, a failed one retried with growing delays instead of lost, an
event during a reconcile running it again, a deleted owner forgotten."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from kvfleet.operator.refresh_queue import RefreshQueue


class Recorder:
    """A reconcile that records (key, time) and fails while `failures` lasts."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[tuple[tuple[str, str], float]] = []
        self.failures = failures
        self.changed = threading.Condition()

    def __call__(self, namespace: str, name: str) -> None:
        with self.changed:
            self.calls.append(((namespace, name), time.monotonic()))
            self.changed.notify_all()
            if self.failures:
                self.failures -= 1
                raise RuntimeError("HTTP 500 Internal Server Error")

    def wait_for(self, count: int, timeout: float = 5.0) -> list:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, timeout), self.calls
            return list(self.calls)


@pytest.fixture
def make_queue():
    queues: list[RefreshQueue] = []

    def make(work, **kwargs) -> RefreshQueue:
        queues.append(RefreshQueue(work, **kwargs))
        return queues[-1]

    yield make
    for q in queues:
        q.stop()


def test_a_burst_of_events_for_one_owner_is_one_reconcile(make_queue):
    work = Recorder()
    queue = make_queue(work)
    for _ in range(50):  # a rollout: every pod's every change, before the worker gets to it
        queue.add("default", "chat")
    queue.add("team-b", "chat")
    queue.start()
    calls = work.wait_for(2)
    time.sleep(0.2)
    assert sorted(key for key, _ in work.calls) == [("default", "chat"), ("team-b", "chat")]
    assert len(calls) == 2 and queue.waiting() == {}


def test_a_failed_reconcile_is_retried_with_doubling_delays_until_it_succeeds(make_queue):
    work = Recorder(failures=3)
    queue = make_queue(work, base_delay=0.05, max_delay=0.15)
    queue.start()
    queue.add("default", "chat")
    calls = work.wait_for(4)
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(calls)]
    assert all(gap >= delay for gap, delay in zip(gaps, (0.05, 0.1, 0.15), strict=True))
    assert gaps[2] < 0.15 + 0.1  # capped at max_delay, not 0.2
    time.sleep(0.3)
    assert len(work.calls) == 4 and queue.waiting() == {}  # the success ended the retries

    work.failures = 1  # a new failure starts again from the base delay
    queue.add("default", "chat")
    calls = work.wait_for(6)
    assert 0.05 <= calls[5][1] - calls[4][1] < 0.1 + 0.05


def test_an_event_during_a_reconcile_runs_it_again_after_it(make_queue):
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []
    lock = threading.Lock()

    def work(namespace: str, name: str) -> None:
        with lock:
            calls.append(f"start {name}")
            first = len(calls) == 1
        if first:
            entered.set()
            release.wait(5)
        with lock:
            calls.append(f"end {name}")

    queue = make_queue(work, workers=4)
    queue.start()
    queue.add("default", "chat")
    assert entered.wait(5)
    queue.add("default", "chat")  # the reconcile under way may have read the child before this
    queue.add("default", "other")  # another owner does not wait for it
    deadline = time.monotonic() + 5
    while "end other" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert calls == ["start chat", "start other", "end other"]  # chat's second run waits
    release.set()
    while len(calls) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[3:] == ["end chat", "start chat", "end chat"]


def test_a_deleted_owners_retry_is_dropped(make_queue):
    work = Recorder(failures=100)
    queue = make_queue(work, base_delay=0.2)
    queue.start()
    queue.add("default", "chat")
    work.wait_for(1)
    deadline = time.monotonic() + 5
    while not queue.waiting() and time.monotonic() < deadline:  # its retry is scheduled
        time.sleep(0.01)
    assert set(queue.waiting()) == {("default", "chat")}
    queue.forget("default", "chat")
    time.sleep(0.4)
    assert len(work.calls) == 1 and queue.waiting() == {}


def test_a_stopped_queue_runs_nothing_more(make_queue):
    work = Recorder()
    queue = make_queue(work)
    queue.start()
    queue.stop()
    queue.add("default", "chat")
    queue.start()  # stays stopped
    time.sleep(0.2)
    assert work.calls == []

"""AutoscalerTasks on its own, with stand-in loops: which watch events start and stop a loop,
the live copy of the object a loop reads, restarts after a crash, the stop timeout, one loop
per object at a time, and the shutdown that ends them all. (test_autoscale_loop.py runs the
real loop under kopf.)"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from kvfleet.operator.autoscale_loop import WatchedObject
from kvfleet.operator.autoscale_tasks import AutoscalerTasks, autoscaling_enabled


def isvc(uid: str = "u1", enabled: bool = True, interval: int = 1, **meta: Any) -> dict:
    return {
        "metadata": {"name": f"svc-{uid}", "namespace": "default", "uid": uid, **meta},
        "spec": {"autoscaling": {"enabled": enabled, "pollIntervalSeconds": interval}},
    }


async def until(predicate: Callable[[], Any], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Loops:
    """A stand-in for autoscale_loop.poll_until_stopped that records what happens."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.watched: dict[str, WatchedObject] = {}

    async def run(self, watched: WatchedObject) -> None:
        uid = watched.body["metadata"]["uid"]
        self.watched[uid] = watched
        self.log.append(f"start {uid}")
        try:
            await watched.stop.wait()
        finally:
            self.log.append(f"end {uid}")


def test_autoscaling_enabled_wants_true_and_no_deletion() -> None:
    assert autoscaling_enabled(isvc())
    assert not autoscaling_enabled(isvc(enabled=False))
    assert not autoscaling_enabled(isvc(deletionTimestamp="2026-01-01T00:00:00Z"))
    assert not autoscaling_enabled({"metadata": {"uid": "u"}, "spec": {"autoscaling": "yes"}})


async def test_the_listing_starts_a_loop_and_turning_autoscaling_off_stops_it() -> None:
    loops = Loops()
    tasks = AutoscalerTasks(loops.run)
    tasks.observe(None, isvc())  # kopf's initial listing: a restarted operator resumes
    tasks.observe(None, isvc("u2", enabled=False))
    await until(lambda: loops.log == ["start u1"])
    assert tasks.running() == {"u1"}

    tasks.observe("MODIFIED", isvc(enabled=False))
    assert tasks.running() == frozenset()
    await until(lambda: loops.log == ["start u1", "end u1"])


@pytest.mark.parametrize(
    ("event", "body"),
    [
        ("DELETED", isvc()),
        ("MODIFIED", isvc(deletionTimestamp="2026-01-01T00:00:00Z")),  # another finalizer holds it
    ],
    ids=["deleted", "being-deleted"],
)
async def test_deletion_stops_the_loop(event: str, body: dict) -> None:
    loops = Loops()
    tasks = AutoscalerTasks(loops.run)
    tasks.observe("ADDED", isvc())
    await until(lambda: loops.log == ["start u1"])
    tasks.observe(event, body)
    await until(lambda: loops.log == ["start u1", "end u1"])
    assert tasks.running() == frozenset()


async def test_each_event_gives_the_loop_a_fresh_copy_of_the_object() -> None:
    loops = Loops()
    tasks = AutoscalerTasks(loops.run)
    first = isvc(interval=1)
    tasks.observe("ADDED", first)
    await until(lambda: "u1" in loops.watched)
    watched = loops.watched["u1"]
    tasks.observe("MODIFIED", isvc(interval=7))
    assert watched.body["spec"]["autoscaling"]["pollIntervalSeconds"] == 7
    first["spec"]["autoscaling"]["pollIntervalSeconds"] = 99  # kopf's dict, changed later
    assert watched.body["spec"]["autoscaling"]["pollIntervalSeconds"] == 7
    assert loops.log == ["start u1"]  # the same loop: its history is kept
    await tasks.stop_all()


async def test_a_loop_that_raises_is_logged_and_started_again(caplog) -> None:
    runs: list[float] = []

    async def flaky(watched: WatchedObject) -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise RuntimeError("the API server answered nonsense")
        await watched.stop.wait()

    tasks = AutoscalerTasks(flaky, restart_backoff=0.2)
    with caplog.at_level(logging.ERROR, logger="kvfleet.autoscaler"):
        tasks.observe("ADDED", isvc())
        await until(lambda: len(runs) == 2)
    assert runs[1] - runs[0] >= 0.2
    assert "default/svc-u1: the autoscaler's loop failed; starting it again" in caplog.text
    assert "the API server answered nonsense" in caplog.text  # with its traceback
    assert tasks.running() == {"u1"}
    await tasks.stop_all()


async def test_a_loop_that_ends_itself_is_forgotten_and_the_next_event_starts_another() -> None:
    runs: list[str] = []

    async def gone_at_once(watched: WatchedObject) -> None:
        runs.append(watched.body["metadata"]["uid"])  # as if it found its object deleted

    tasks = AutoscalerTasks(gone_at_once)
    tasks.observe("ADDED", isvc())
    await until(lambda: runs == ["u1"] and tasks.running() == frozenset())
    tasks.observe("MODIFIED", isvc())
    await until(lambda: runs == ["u1", "u1"])


async def test_a_loop_that_ignores_stop_is_cancelled_after_the_timeout() -> None:
    ended: list[str] = []

    async def stubborn(watched: WatchedObject) -> None:
        try:
            await asyncio.sleep(60)  # a poll that hangs
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    tasks = AutoscalerTasks(stubborn, stop_timeout=0.2)
    tasks.observe("ADDED", isvc())
    await asyncio.sleep(0.05)
    started = time.monotonic()
    tasks.observe("DELETED", isvc())
    await until(lambda: ended == ["cancelled"])
    assert 0.15 <= time.monotonic() - started < 2


async def test_turned_on_again_the_new_loop_waits_for_the_old_one() -> None:
    log: list[str] = []

    async def slow_to_stop(watched: WatchedObject) -> None:
        log.append("start")
        await watched.stop.wait()
        await asyncio.sleep(0.2)  # finishing the poll it was in
        log.append("end")

    tasks = AutoscalerTasks(slow_to_stop)
    tasks.observe("ADDED", isvc())
    await until(lambda: log == ["start"])
    tasks.observe("MODIFIED", isvc(enabled=False))
    tasks.observe("MODIFIED", isvc())
    await until(lambda: len(log) == 3)
    assert log == ["start", "end", "start"]  # never two polls of one object at once
    await tasks.stop_all()


async def test_stop_all_ends_every_loop_and_cancels_those_that_hang() -> None:
    loops = Loops()

    async def run(watched: WatchedObject) -> None:
        if watched.body["metadata"]["uid"] == "hung":
            await asyncio.sleep(60)
        await loops.run(watched)

    tasks = AutoscalerTasks(run, stop_timeout=0.2)
    for uid in ("a", "b", "hung"):
        tasks.observe(None, isvc(uid))
    await until(lambda: len(loops.log) == 2)
    started = time.monotonic()
    await tasks.stop_all()
    assert time.monotonic() - started < 2
    assert sorted(loops.log) == ["end a", "end b", "start a", "start b"]
    assert tasks.running() == frozenset()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("autoscaler ")]


async def test_an_event_without_a_uid_is_ignored() -> None:
    loops = Loops()
    tasks = AutoscalerTasks(loops.run)
    tasks.observe("ADDED", {"metadata": {"name": "x"}, "spec": {"autoscaling": {"enabled": True}}})
    await asyncio.sleep(0.05)
    assert tasks.running() == frozenset() and loops.log == []

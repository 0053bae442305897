"""CPU seconds that processes spend over a benchmark's timed window, read from Linux's /proc.

Why: on a CPU host the server, the engine core and the bench client share the same cores, so a
served run can fall behind the offline one because the host ran out of cores rather than
because any part is slow. `bench serve --spawn` reports each part's CPU seconds beside the
core-seconds the host had, and `bench throughput` its own, which tells the two apart.
Elsewhere than Linux nothing is measured (the readings are None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (which is in parentheses and may hold
    spaces): state, parent, ...; None where the process is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process `pid`, every thread of it (None: no such
    process, or no /proc)."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        fields = _stat(name) if name.isdigit() else None  # None too: ended while we looked
        if fields is not None and int(fields[1]) == pid:
            found.append(int(name))
    return found


def descendants(pid: int) -> list[int]:
    """Children of `pid`, their children, and so on."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def usable_cpus() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds per role ("client", "server", ...: each a list of processes) between
    `start()` and `stop()`, and the core-seconds the host had meanwhile. A process that ends
    inside the window counts what it had used at the start only, so the roles should be
    processes that outlive it."""

    roles: dict[str, list[int]]
    _start: dict[int, float] = field(default_factory=dict)
    _time: float = 0.0

    def start(self) -> None:
        self._time = time.perf_counter()
        for pids in self.roles.values():
            for pid in pids:
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    self._start[pid] = seconds

    def stop(self) -> dict[str, float] | None:
        """{role: CPU seconds, ..., "available": wall seconds × usable cores}; None where
        nothing could be read."""
        wall = time.perf_counter() - self._time
        if not self._start:
            return None
        used = {}
        for role, pids in self.roles.items():
            total = 0.0
            for pid in pids:
                now = cpu_seconds(pid)
                if pid in self._start and now is not None:
                    total += now - self._start[pid]
            used[role] = round(total, 3)
        used["available"] = round(wall * usable_cpus(), 3)
        return used

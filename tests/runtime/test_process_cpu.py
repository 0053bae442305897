"""The CPU seconds `bench serve` and `bench throughput` report per process (process_cpu.py): a
busy process is seen busy, an idle one idle, a grandchild is found, and the host's core-seconds
bound what all of them used."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kvfleet.runtime.bench.process_cpu import (
    CpuMeter,
    cpu_seconds,
    descendants,
    usable_cpus,
)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

# Spins on the CPU until killed / sleeps until killed; each says "ready" first.
BUSY = "print('ready', flush=True)\nwhile True: pass"
IDLE = "import time\nprint('ready', flush=True)\ntime.sleep(600)"
# A child that starts a busy grandchild and waits on it.
PARENT = (
    "import subprocess, sys\n"
    f"child = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
    "print(child.pid, flush=True)\n"
    "child.wait()"
)


def _start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # started: its interpreter's start-up is behind it
    return proc


def _stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_a_busy_process_is_seen_busy_and_an_idle_one_idle() -> None:
    busy, idle = _start(BUSY), _start(IDLE)
    try:
        meter = CpuMeter({"busy": [busy.pid], "idle": [idle.pid]})
        meter.start()
        time.sleep(0.6)
        used = meter.stop()
    finally:
        _stop(busy, idle)
    assert used is not None
    # One core's worth while it ran, less what the 2-core host gave the others.
    assert used["busy"] > 0.25
    assert used["idle"] < 0.05
    assert used["available"] == pytest.approx(0.6 * usable_cpus(), rel=0.2)
    assert used["busy"] + used["idle"] <= used["available"]


def test_the_processes_a_process_started_are_found_with_their_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert descendants(parent.pid) == [grandchild]
        assert os.getpid() not in descendants(parent.pid)
        assert parent.pid in descendants(os.getpid())
        assert grandchild in descendants(os.getpid())
    finally:
        os.kill(grandchild, 9)
        _stop(parent)


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    proc = _start(IDLE)
    _stop(proc)
    assert cpu_seconds(proc.pid) is None
    meter = CpuMeter({"server": [proc.pid]})
    meter.start()
    assert meter.stop() is None  # nothing could be read: no figure rather than a zero


def test_this_process_counts_its_own_threads() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    after = cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.15

"""`kvfleet serve` runs the engine core in a process of its own: the server notices at once when
that process dies, however it dies, and nobody is left waiting on a stream that will never end.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from server_fixtures import (
    ServerProcess,
    open_stream,
    read_events,
    request,
    running_server,
    start_server,
)


def core_pid(server: ServerProcess) -> int:
    """The engine core: the server's child started by multiprocessing's spawn (its other
    child, multiprocessing's resource tracker, is not it)."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text()
    (pid,) = [
        int(p) for p in children.split() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    return pid


def health_fails_within(server: ServerProcess, seconds: float) -> float:
    """Poll /health until a probe fails (503, or the port closed as the server exits); return
    how long that took."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            status = request(server.port, "GET", "/health", timeout=1).status
        except OSError:
            return time.monotonic() - start
        if status != 200:
            assert status == 503, status
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"/health still 200 after {seconds} s:\n{server.log()}")


def test_a_core_killed_mid_stream_ends_every_stream_and_the_server_exits(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_llama_dir, tmp_path)
    try:
        server.wait_healthy()
        body = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streams = [open_stream(server.port, "/v1/completions", body)[1] for _ in range(3)]
        chat = {
            "messages": [{"role": "user", "content": "Tell me everything"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        streams.append(open_stream(server.port, "/v1/chat/completions", chat)[1])
        for resp in streams:
            assert read_events(resp, 2)

        os.kill(core_pid(server), signal.SIGKILL)

        assert health_fails_within(server, 2.0) < 2.0
        for resp in streams:
            events = read_events(resp)
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_unavailable", error
            assert "killed by signal 9" in error["message"]
        assert server.proc.wait(30) == 1
        assert "exiting so that the process is restarted" in server.log()
    finally:
        server.terminate()


def test_sigterm_drains_streams_then_stops_the_core(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama_dir, tmp_path)
    try:
        server.wait_healthy()
        core = core_pid(server)
        body = {"prompt": "Count", "max_tokens": 60, "ignore_eos": True, "stream": True}
        _conn, resp = open_stream(server.port, "/v1/completions", body)
        assert read_events(resp, 1)

        server.proc.send_signal(signal.SIGTERM)

        events = read_events(resp)
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the stream ran to its end, not cut by the signal
        assert server.proc.wait(30) == 0
        assert not Path(f"/proc/{core}").exists() or _is_zombie(core), "the core outlived it"
    finally:
        server.terminate()


def test_a_killed_server_takes_its_core_with_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with running_server(tiny_llama_dir, tmp_path) as server:
        core = core_pid(server)
        server.proc.kill()
        server.proc.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{core}").exists() and not _is_zombie(core):
            assert time.monotonic() < deadline, "the core outlived a SIGKILLed server"
            time.sleep(0.05)


def test_an_idle_server_keeps_its_core_asleep(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """No busy loop: an idle core uses (next to) no CPU between requests."""
    with running_server(tiny_llama_dir, tmp_path) as server:
        core = core_pid(server)
        before = _cpu_seconds(core)
        time.sleep(2.0)
        assert _cpu_seconds(core) - before < 0.2


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

"""A real `kvfleet serve` subprocess on 127.0.0.1 for the server tests, and /metrics reading.

Each test module starts its own server (module scope): a fresh process per configuration,
bounded start-up wait, SIGTERM then SIGKILL on teardown, its log attached to failures.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 120.0


@dataclass(slots=True)
class HTTPResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> HTTPResult:
    """One HTTP request with the standard library (raw bytes pass through unchanged)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return HTTPResult(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def assert_error(r: HTTPResult, status: int, param: str | None = None, *words: str) -> dict:
    """`r` is an OpenAI error object with this status and `param`, its message holding every
    one of `words`; returns the error."""
    assert r.status == status, r.body[:500]
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> list[int]:
        """Poll /health until 200; return every status seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                code = request(self.port, "GET", "/health", timeout=2).status
            except OSError:
                time.sleep(0.1)
                continue
            seen.append(code)
            if code == 200:
                return seen
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(
    model: Path | str,
    log_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    launcher: Path | None = None,
) -> ServerProcess:
    """Start `kvfleet serve --model MODEL ARGS` on a free port (not yet waited for); `env`
    adds to (or overrides) the environment, where KVFLEET_API_KEY is otherwise unset.
    `launcher`: a script run instead of the CLI module, with the same arguments."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    program = [str(launcher)] if launcher else ["-m", "kvfleet.runtime.cli"]
    cmd = [
        sys.executable,
        *program,
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        "--num-threads",
        "1",
        *args,
    ]
    full_env = {**os.environ}
    full_env.pop("KVFLEET_API_KEY", None)
    full_env.update(env or {})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return ServerProcess(proc, port, log_path)


@contextmanager
def running_server(
    model: Path | str, log_dir: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    server = start_server(model, log_dir, *args, env=env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.terminate()


def scrape(server: ServerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics parsed by prometheus_client: {(sample name, labels): value}."""
    result = request(server.port, "GET", "/metrics", timeout=10)
    assert result.status == 200, result.body
    text = result.body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """The one sample named `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def wait_for_metric(server: ServerProcess, name: str, predicate, timeout: float = 15.0) -> float:
    """Poll /metrics until `predicate(value)`; return the value (fails on timeout)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = metric(scrape(server), name)
        if predicate(value):
            return value
        time.sleep(0.05)
    raise AssertionError(f"{name} stayed at {value} for {timeout} s")


def open_stream(
    port: int, path: str, body: dict[str, Any], timeout: float = 60
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST a streaming request with the standard library, whose socket a test can close to
    hang up mid-stream (the openai client hides it); returns the connection and its 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    return conn, resp


def read_events(resp: http.client.HTTPResponse, count: int | None = None) -> list[str]:
    """The `data:` payloads of a Server-Sent Events stream: `count` of them, or up to [DONE]."""
    events = []
    while count is None or len(events) < count:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[6:].decode().strip())
            if events[-1] == "[DONE]":
                break
    return events

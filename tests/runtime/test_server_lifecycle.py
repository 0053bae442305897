"""`kvfleet serve`'s lifecycle: /health is 503 until the model is loaded and warmed up, and
SIGTERM drains — /health 503, new requests 503, the in-flight request completes, exit 0."""

from __future__ import annotations

import http.client
import json
import signal
import time
from pathlib import Path

import pytest
from server_fixtures import request, start_server

from kvfleet import contract


def _read_events(resp: http.client.HTTPResponse, count: int | None = None) -> list[str]:
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


def test_health_waits_for_the_model_and_sigterm_drains_in_flight_requests(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_llama_dir, tmp_path, "--drain-timeout", "60")
    try:
        seen = server.wait_healthy()
        assert seen[0] == 503 and seen[-1] == 200  # the port opens before the model is ready

        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {
            "prompt": "A long story",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        events = _read_events(resp, 3)

        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while request(server.port, "GET", contract.HEALTH_PATH).status != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 after SIGTERM"
            time.sleep(0.02)
        refused = request(server.port, "POST", "/v1/completions", {"prompt": "x"})
        assert refused.status == 503
        assert "shutting down" in refused.json()["error"]["message"]
        assert server.proc.poll() is None  # still serving the in-flight request

        events += _read_events(resp)
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 200
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
        assert finishes[-1] == "length"
        assert server.proc.wait(30) == 0
    finally:
        server.terminate()


@pytest.mark.parametrize("flag", [("--max-waiting-requests", "0"), ("--drain-timeout", "-1")])
def test_bad_serve_flags_exit_2_naming_the_flag(tmp_path: Path, flag: tuple[str, str]) -> None:
    server = start_server("random:tiny", tmp_path, *flag)
    assert server.proc.wait(60) == 2
    assert flag[0].lstrip("-").replace("-", "_") in server.log()

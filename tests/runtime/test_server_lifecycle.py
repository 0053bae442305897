"""`kvfleet serve`'s lifecycle: /health is 503 until the model is loaded and warmed up, and
SIGTERM drains — /health 503, new requests 503, the in-flight request completes, exit 0."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from server_fixtures import open_stream, read_events, request, start_server

from kvfleet import contract


def test_health_waits_for_the_model_and_sigterm_drains_in_flight_requests(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = start_server(tiny_llama_dir, tmp_path, "--drain-timeout", "60")
    try:
        seen = server.wait_healthy()
        assert seen[0] == 503 and seen[-1] == 200  # the port opens before the model is ready

        body = {
            "prompt": "A long story",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        _conn, resp = open_stream(server.port, "/v1/completions", body)
        events = read_events(resp, 3)

        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while request(server.port, "GET", contract.HEALTH_PATH).status != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 after SIGTERM"
            time.sleep(0.02)
        refused = request(server.port, "POST", "/v1/completions", {"prompt": "x"})
        assert refused.status == 503
        assert "shutting down" in refused.json()["error"]["message"]
        assert server.proc.poll() is None  # still serving the in-flight request

        events += read_events(resp)
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

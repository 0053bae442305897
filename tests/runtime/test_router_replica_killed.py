"""A replica SIGKILLed under load behind `kvfleet router` (three real `kvfleet serve` processes
of the tiny model, all on 127.0.0.1): every request that had not started streaming still
succeeds, on the replicas left, and the router takes the dead one out."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_fixtures import ServerProcess, free_port, metric, request, scrape, start_server

pytestmark = pytest.mark.timeout(300)

REQUESTS = 30


def test_requests_in_flight_on_a_killed_replica_are_served_by_the_others(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    replicas = [start_server(tiny_llama_dir, tmp_path) for _ in range(3)]
    router = None
    try:
        for s in replicas:
            s.wait_healthy()
        port = free_port()
        argv = [sys.executable, "-m", "kvfleet.runtime.cli", "router", "--port", str(port)]
        argv += ["--scrape-interval", "0.2"]
        for s in replicas:
            argv += ["--upstream", s.url]
        log_path = tmp_path / "router.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        router = ServerProcess(proc, port, log_path)
        router.wait_healthy(30)
        model = request(port, "GET", "/v1/models").json()["data"][0]["id"]
        done = threading.Semaphore(0)
        finished = []  # one entry per completed request, appended under the GIL

        def complete(i: int) -> tuple[int, str]:
            # Distinct prompts: no prefix affinity, so the load spreads over all three.
            body = {"model": model, "prompt": f"Request {i}: count to {i + 5}.", "max_tokens": 48}
            body["ignore_eos"] = True
            r = request(port, "POST", "/v1/completions", body, timeout=120)
            finished.append(i)
            done.release()
            return r.status, r.body.decode()

        victim = replicas[0]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(complete, i) for i in range(REQUESTS)]
            for _ in range(4):  # under load: requests are in flight on every replica
                done.acquire(timeout=120)
            victim.proc.kill()
            before_kill = len(finished)
            results = [f.result() for f in futures]
        assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200]
        served = [
            metric(samples, "vllm:request_success_total", finished_reason="length")
            for samples in map(scrape, replicas[1:])
        ]
        # Whatever had not finished when the victim died was served by the replicas left.
        assert sum(served) >= REQUESTS - before_kill
    finally:
        if router is not None:
            router.terminate()
        for s in replicas:
            s.terminate()

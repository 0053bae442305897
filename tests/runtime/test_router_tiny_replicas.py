"""`kvfleet router` as a process in front of two real `kvfleet serve` processes of the tiny
model, all on 127.0.0.1: answers equal the replicas' own, prompts sharing a prefix are all
served (and cached) by one replica, a client hanging up aborts the replica's request, and
the replicas expose the GIE model-server protocol's `vllm:cache_config_info`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_fixtures import (
    ServerProcess,
    free_port,
    metric,
    open_stream,
    read_events,
    request,
    scrape,
    start_server,
    wait_for_metric,
)

pytestmark = pytest.mark.timeout(300)

SHARED = "You are a careful assistant who answers questions about the solar system. " * 8


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, tmp_path_factory) -> Iterator[list[ServerProcess]]:
    log_dir = tmp_path_factory.mktemp("router-replicas")
    servers = [start_server(tiny_llama_dir, log_dir) for _ in range(2)]
    try:
        for s in servers:
            s.wait_healthy()
        yield servers
    finally:
        for s in servers:
            s.terminate()


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess], tmp_path_factory) -> Iterator[ServerProcess]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    argv = [sys.executable, "-m", "kvfleet.runtime.cli", "router", "--port", str(port)]
    argv += ["--scrape-interval", "0.2"]
    for s in replicas:
        argv += ["--upstream", s.url]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, port, log_path)
    try:
        server.wait_healthy(30)
        yield server
    finally:
        assert server.terminate() == 0, server.log()


def test_answers_through_the_router_equal_a_replicas_own(router, replicas):
    model = openai.OpenAI(base_url=replicas[0].api_url, api_key="k").models.list().data[0].id
    via = openai.OpenAI(base_url=router.api_url, api_key="k", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=replicas[0].api_url, api_key="k", max_retries=0, timeout=60)
    args = {"model": model, "prompt": "The solar system has", "max_tokens": 8, "temperature": 0}
    assert via.completions.create(**args).choices[0].text == (
        direct.completions.create(**args).choices[0].text
    )
    messages = [{"role": "user", "content": "Name a planet."}]
    chat = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
    streamed = via.chat.completions.create(**chat, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == direct.chat.completions.create(**chat).choices[0].message.content


def test_prompts_sharing_a_prefix_are_served_and_cached_by_one_replica(router, replicas):
    client = openai.OpenAI(base_url=router.api_url, api_key="k", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    before = [scrape(s) for s in replicas]
    for i in range(5):
        client.completions.create(
            model=model, prompt=f"{SHARED}Question {i}: which planet?", max_tokens=2
        )
    after = [scrape(s) for s in replicas]

    def delta(i: int, name: str) -> float:
        return metric(after[i], name) - metric(before[i], name)

    served = [delta(i, "vllm:prefix_cache_queries_total") > 0 for i in range(2)]
    assert sorted(served) == [False, True], served  # one replica saw all five
    hot = served.index(True)
    # Four of the five found the shared prefix in that replica's cache.
    assert delta(hot, "vllm:prefix_cache_hits_total") >= 4 * 16
    picks = scrape(router)
    # The first placed the prefix (a new key), the other four went back to it.
    assert metric(picks, "kvfleet_router_picks_total", reason="new_prefix") >= 1
    assert metric(picks, "kvfleet_router_picks_total", reason="affinity") >= 4


def aborts(server: ServerProcess) -> float:
    return metric(scrape(server), "vllm:request_success_total", finished_reason="abort")


def test_a_client_hanging_up_aborts_the_request_on_the_replica(router, replicas):
    model = request(router.port, "GET", "/v1/models").json()["data"][0]["id"]
    aborted = [aborts(s) for s in replicas]
    body = {"model": model, "prompt": SHARED, "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    conn, resp = open_stream(router.port, "/v1/completions", body)
    assert read_events(resp, 2)
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = [aborts(s) for s in replicas]
        if sum(now) == sum(aborted) + 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no replica aborted the request: {aborted} -> {now}")
    for s in replicas:
        wait_for_metric(s, "vllm:num_requests_running", lambda v: v == 0)


def test_replicas_expose_their_cache_config_for_routers(replicas):
    info = [labels for (name, labels) in scrape(replicas[0]) if name == "vllm:cache_config_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert labels["block_size"] == "16"
    assert int(labels["num_gpu_blocks"]) > 0
    assert labels["enable_prefix_caching"] == "True"


def test_bad_flags_are_refused_naming_the_flag():
    argv = [sys.executable, "-m", "kvfleet.runtime.cli", "router"]
    for flags, word in (
        (["--upstream", "10.0.0.1:8000"], "upstream"),
        (["--upstream", "http://a:1", "--upstream", "http://a:1"], "upstream"),
        (["--upstream", "http://a:1", "--load-factor", "0.5"], "load_factor"),
        (["--upstream", "http://a:1", "--scrape-interval", "0"], "scrape_interval"),
    ):
        run = subprocess.run(argv + flags, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, run.stderr
        assert word in run.stderr and "Traceback" not in run.stderr

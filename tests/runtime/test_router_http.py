"""`kvfleet router` over HTTP against fake replicas on 127.0.0.1 (fake_replica.py): streams
pass through to [DONE], a replica dying mid-stream ends the stream with an error event and
[DONE], requests sharing a system prompt meet one replica, and load, health, refusals and
client disconnects are handled."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from fake_replica import STREAM_CHUNKS, FakeReplica, running
from kvfleet.runtime.router.app import Router
from kvfleet.runtime.router.policy import PolicySettings
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.settings import RouterSettings
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

SYSTEM_PROMPTS = [f"You are assistant number {i}. " * 10 for i in range(8)]


@contextlib.asynccontextmanager
async def router_over(*replicas: FakeReplica, **settings) -> AsyncIterator[tuple[str, Router]]:
    """The router's app on 127.0.0.1 in front of the fakes (scraped every 50 ms)."""
    policy = PolicySettings(**settings.pop("policy", {}))
    opts = {"scrape_interval": 0.05, "scrape_timeout": 1.0, "request_timeout": 20.0, **settings}
    async with running(*replicas) as urls:
        router = Router(ReplicaPool(urls), RouterSettings(policy=policy, **opts))
        server = TestServer(router.app())
        await server.start_server()
        try:
            yield str(server.make_url("")).rstrip("/"), router
        finally:
            await server.close()


def chat(system: str, user: str, stream: bool = False) -> dict:
    return {
        "model": "fake",
        "stream": stream,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, bytes]:
    async with session.post(url, json=body) as r:
        return r.status, await r.read()


def events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]


async def router_metrics(url: str) -> dict[tuple[str, frozenset], float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        (x.name, frozenset(x.labels.items())): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_streams_and_answers_pass_through_the_openai_client():
    a = FakeReplica("a")
    async with router_over(a) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=20)
        stream = await client.completions.create(model="fake", prompt="Hi", stream=True)
        texts = [c.choices[0].text async for c in stream]
        assert texts == [f"a-{i}" for i in range(STREAM_CHUNKS)]
        chat_stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        assert len([c async for c in chat_stream]) == STREAM_CHUNKS
        whole = await client.completions.create(model="fake", prompt="Hi")
        assert whole.choices[0].text == "a"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake"]
        await client.close()
    assert a.bodies[0] == {"model": "fake", "prompt": "Hi", "stream": True}


async def test_a_stream_relays_every_event_unchanged_and_ends_with_done():
    async with router_over(FakeReplica("a")) as (url, _), aiohttp.ClientSession() as s:
        status, raw = await post(s, f"{url}/v1/chat/completions", chat("sys", "hi", True))
    assert status == 200
    got = events(raw)
    assert got[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in got[:-1]] == ["a-0", "a-1", "a-2"]


async def test_a_replica_dying_mid_stream_gives_an_error_event_then_done():
    a = FakeReplica("a", break_stream_after=1)
    async with router_over(a) as (url, _), aiohttp.ClientSession() as s:
        status, raw = await post(s, f"{url}/v1/completions", {"prompt": "x", "stream": True})
        metrics = await router_metrics(url)
    got = events(raw)
    assert status == 200
    assert json.loads(got[0])["choices"][0]["text"] == "a-0"  # the whole event before the cut
    error = json.loads(got[1])["error"]  # and not the half-written one
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "upstream_error" and a.url in error["message"]
    assert got[2:] == ["[DONE]"]
    labels = frozenset({"upstream": a.url, "kind": "stream"}.items())
    assert metrics[("kvfleet_router_upstream_errors_total", labels)] == 1


async def test_requests_sharing_a_system_prompt_meet_one_replica():
    replicas = [FakeReplica(n) for n in "abc"]
    async with router_over(*replicas) as (url, _), aiohttp.ClientSession() as s:
        for round_ in range(4):
            for i, system in enumerate(SYSTEM_PROMPTS):
                status, _raw = await post(
                    s, f"{url}/v1/chat/completions", chat(system, f"question {round_}-{i}")
                )
                assert status == 200
        metrics = await router_metrics(url)
    where: dict[str, set[str]] = {}
    for r in replicas:
        for body in r.bodies:
            where.setdefault(body["messages"][0]["content"], set()).add(r.name)
    assert all(len(names) == 1 for names in where.values()), where
    # Placed where the fewest keys were, not hashed: eight prompts over three replicas, 3/3/2.
    spread = Counter(next(iter(names)) for names in where.values())
    assert sorted(spread.values()) == [2, 3, 3], where
    picks = {
        r: metrics[("kvfleet_router_picks_total", frozenset({"reason": r}.items()))]
        for r in ("new_prefix", "affinity")
    }
    assert picks == {"new_prefix": 8, "affinity": 24}


async def test_an_overloaded_or_unhealthy_affine_replica_is_passed_over():
    replicas = [FakeReplica(n) for n in "abc"]
    async with router_over(*replicas) as (url, router), aiohttp.ClientSession() as s:
        body = chat(SYSTEM_PROMPTS[0], "q")
        await post(s, f"{url}/v1/chat/completions", body)
        (affine,) = [r for r in replicas if r.bodies]
        affine.waiting = 50  # a deep queue, seen at the next scrape
        await wait_until(lambda: router.pool.get(affine.url).waiting == 50)
        _, raw = await post(s, f"{url}/v1/chat/completions", body)
        spill = json.loads(raw)["served_by"]
        assert spill != affine.name
        affine.waiting, affine.health_status = 0, 503  # not overloaded now, but not ready
        await wait_until(lambda: not router.pool.get(affine.url).healthy)
        _, raw = await post(s, f"{url}/v1/chat/completions", body)
        # Its prefixes all move to one runner-up, the same one each time.
        assert json.loads(raw)["served_by"] == spill
        metrics = await router_metrics(url)
    for reason in ("fallback_overloaded", "fallback_unhealthy"):
        assert metrics[("kvfleet_router_picks_total", frozenset({"reason": reason}.items()))] == 1


async def test_a_replica_refusing_with_503_is_retried_on_another():
    full, ok = FakeReplica("full", generate_status=503), FakeReplica("ok")
    async with router_over(full, ok, policy={"policy": "random"}, seed=1) as (url, _):
        async with aiohttp.ClientSession() as s:
            answers = [await post(s, f"{url}/v1/completions", {"prompt": "x"}) for _ in range(8)]
        metrics = await router_metrics(url)
    assert all(status == 200 and json.loads(b)["served_by"] == "ok" for status, b in answers)
    assert full.bodies  # it was tried
    assert metrics[("kvfleet_router_retries_total", frozenset())] == len(full.bodies)


async def test_a_replica_error_other_than_503_is_relayed_as_it_is():
    bad = FakeReplica("bad", generate_status=500)
    async with router_over(bad) as (url, _), aiohttp.ClientSession() as s:
        status, raw = await post(s, f"{url}/v1/completions", {"prompt": "x"})
    assert status == 500 and json.loads(raw)["error"]["message"] == "bad"


async def test_a_refused_connection_takes_the_replica_out_and_the_request_goes_elsewhere():
    gone, ok = FakeReplica("gone"), FakeReplica("ok")
    async with router_over(gone, ok, policy={"policy": "random"}, seed=3, scrape_interval=30):
        pass  # only to learn a URL nothing listens on once it is closed
    async with running(ok) as (ok_url,):
        pool = ReplicaPool([gone.url, ok_url])
        router = Router(pool, RouterSettings(PolicySettings("random"), scrape_interval=30))
        server = TestServer(router.app())
        await server.start_server()
        pool.record_scrape(gone.url, healthy=True)  # as if it had just died after a good scrape
        url = str(server.make_url("")).rstrip("/")
        try:
            async with aiohttp.ClientSession() as s:
                results = [
                    await post(s, f"{url}/v1/completions", {"prompt": "x"}) for _ in range(6)
                ]
            assert all(status == 200 for status, _ in results)
            assert not pool.get(gone.url).healthy
        finally:
            await server.close()


async def test_no_healthy_replica_is_a_503_in_openai_shape_after_the_wait():
    down = FakeReplica("down", health_status=503)
    async with router_over(down, wait_for_replica=0.2) as (url, _), aiohttp.ClientSession() as s:
        async with s.get(f"{url}/health") as r:
            assert r.status == 503
        async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "no_replica"
        down.health_status = 200  # it comes up: a waiting request is served
        async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 200 and (await r.json())["replicas"] == {down.url: "ok"}
    assert down.bodies == [{"prompt": "x"}]


async def test_a_client_hanging_up_aborts_the_upstream_request():
    a = FakeReplica("a", hold=asyncio.Event())
    async with router_over(a) as (url, router):
        body = {"prompt": "x", "stream": True}
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
            assert router.pool.get(a.url).in_flight == 1
        # leaving the block closed the connection mid-stream
        await wait_until(lambda: a.cancelled == 1)
        await wait_until(lambda: router.pool.get(a.url).in_flight == 0)


async def test_load_spreads_requests_without_a_prefix_and_the_block_size_is_read():
    replicas = [FakeReplica("a", running=5), FakeReplica("b", block_size=8), FakeReplica("c")]
    replicas[2].running = 2
    async with router_over(*replicas) as (url, router), aiohttp.ClientSession() as s:
        assert router.pool.block_size == 8  # the smallest a replica reports
        answers = [await post(s, f"{url}/v1/completions", {"prompt": "short"}) for _ in range(3)]
    served = Counter(json.loads(b)["served_by"] for _, b in answers)
    assert served == {"b": 3}  # least loaded each time (requests run one after another)

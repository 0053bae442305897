"""`kvfleet router` with an API key (the replicas' own, from the same Secret): a client without
it gets the runtime's 401 before anything is routed, held or woken from zero; /health and
/metrics stay open; /tokenize and /detokenize are relayed to a replica."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from fake_replica import FakeReplica
from kube_harness import DEPLOYMENT, eventually, kube
from kvfleet.runtime.router import api_key
from kvfleet.runtime.router.app import Router
from kvfleet.runtime.router.cmd_router import settings_from_args
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.settings import RouterSettings
from test_router_activator import activator_settings, deployment, replicas
from test_router_discovery import _args
from test_router_http import router_over

__all__ = ["kube"]
pytestmark = pytest.mark.timeout(60)
KEY = "sk-test-1234"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
GUARDED = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "fake", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": "fake", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "fake", "tokens": [7, 9]}),
]


async def call(url: str, method: str, path: str, body: dict | None, headers: dict | None = None):
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer sk-test-12"},
                                     {"Authorization": f"Basic {KEY}"}])  # fmt: skip
async def test_without_the_key_nothing_is_routed_and_the_answer_is_the_runtimes_401(headers):
    replica = FakeReplica("a")
    async with router_over(replica, api_key=KEY) as (url, _):
        for method, path, body in GUARDED:
            status, answer = await call(url, method, path, body, headers)
            assert status == 401, path
            assert answer == {
                "error": {
                    "message": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        # Probes and Prometheus need no key, as on the runtime.
        assert (await call(url, "GET", "/health", None))[0] == 200
        async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
            assert r.status == 200
    assert replica.bodies == []


async def test_a_client_with_the_key_is_served_through_the_openai_client():
    replica = FakeReplica("a")
    async with router_over(replica, api_key=KEY) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake"]
        wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            await wrong.models.list()
        assert refused.value.code == "invalid_api_key"
        await client.close()
        await wrong.close()
        auth = {"Authorization": f"Bearer {KEY}"}
        for method, path, body in GUARDED:
            assert (await call(url, method, path, body, auth))[0] == 200, path


async def test_tokenize_and_detokenize_reach_a_replica_that_serves_the_model():
    plain, tuned = FakeReplica("plain"), FakeReplica("tuned", adapters={"sql"})
    async with router_over(plain, tuned) as (url, router):
        await eventually(lambda: all(r.healthy for r in router.pool.replicas))
        status, answer = await call(url, "POST", "/tokenize", {"model": "fake", "prompt": "hi"})
        assert status == 200 and answer["tokens"] == [7, 9]
        for _ in range(4):  # the adapter's requests go where it is loaded
            status, answer = await call(url, "POST", "/tokenize", {"model": "sql", "prompt": "x"})
            assert (status, answer["served_by"]) == (200, "tuned")
        status, answer = await call(url, "POST", "/detokenize", {"model": "fake", "tokens": [7]})
        assert status == 200 and answer["prompt"] == "hi"
    assert {"model": "sql", "prompt": "x"} in tuned.bodies


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = api_key.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_key.hmac, "compare_digest", spy)
    assert api_key.authorized(f"Bearer {KEY}", KEY)
    assert api_key.authorized(f"bearer  {KEY} ", KEY)
    assert not api_key.authorized("Bearer sk-test-123", KEY)
    assert not api_key.authorized(f"Token {KEY}", KEY)  # compared all the same: no early exit
    assert compared[2] == (b"sk-test-123", KEY.encode()) and len(compared) == 4


def test_the_key_comes_from_the_flag_or_the_replicas_variable(monkeypatch):
    monkeypatch.delenv("KVFLEET_API_KEY", raising=False)
    assert settings_from_args(_args("--upstream", "http://x:1"))[1].api_key is None
    monkeypatch.setenv("KVFLEET_API_KEY", "from-secret")
    assert settings_from_args(_args("--upstream", "http://x:1"))[1].api_key == "from-secret"
    flag = _args("--upstream", "http://x:1", "--api-key", "from-flag")
    assert settings_from_args(flag)[1].api_key == "from-flag"
    monkeypatch.setenv("KVFLEET_API_KEY", "")
    with pytest.raises(ValueError, match=r"api_key: \$KVFLEET_API_KEY is set but empty"):
        settings_from_args(_args("--upstream", "http://x:1"))
    with pytest.raises(ValueError, match="api_key: --api-key is empty"):
        settings_from_args(_args("--upstream", "http://x:1", "--api-key", " "))


async def test_a_request_without_the_key_never_wakes_a_deployment_at_zero(kube):
    k8s = kube.emulator
    k8s.create_object(DEPLOYMENT, deployment(0))
    settings = RouterSettings(scrape_interval=0.2, request_timeout=20.0, api_key=KEY)
    activator = activator_settings(kube.url, timeout=1.0)
    server = TestServer(Router(ReplicaPool([]), settings, None, activator).app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        status, answer = await call(url, "POST", "/v1/chat/completions", CHAT)
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key")
        await asyncio.sleep(0.3)
        assert replicas(k8s) == 0  # nobody without the key may start a GPU
        held = asyncio.create_task(
            call(url, "POST", "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}"})
        )
        await eventually(lambda: replicas(k8s) == 1, timeout=5)
        status, answer = await asyncio.wait_for(held, 10)  # no pod comes up in this test
        assert (status, answer["error"]["code"]) == (503, "cold_start_timeout")
    finally:
        await server.close()

"""Scale from zero in `kvfleet router --activate-deployment`: a request that finds no ready
replica is held, the Deployment goes 0 → 1 through its scale subresource (the emulator's), and
the request is answered once a replica is ready; bounded by a queue limit and a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from kube_harness import DEPLOYMENT, eventually, kube
from kvfleet.runtime.router.activator import (
    FIELD_MANAGER,
    RETRY_AFTER_S,
    ActivatorSettings,
    ScaleClient,
    admit,
    queue_full_error,
    scale_up_patch,
    timeout_error,
)
from kvfleet.runtime.router.app import Router
from kvfleet.runtime.router.cmd_router import activator_from_args
from kvfleet.runtime.router.discovery import DiscoverySettings, PodDiscovery
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.settings import RouterSettings
from test_router_discovery import SELECTOR, _args, fakes_on_pod_ips, put_pod

__all__ = ["kube"]
pytestmark = pytest.mark.timeout(60)
BODY = {"model": "fake", "prompt": "hello"}


# --- the decisions (pure) -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ready", "held", "limit", "verdict"),
    [(True, 0, 1, "forward"), (True, 5, 1, "forward"), (False, 0, 1, "hold"),
     (False, 1, 1, "refuse"), (False, 99, 100, "hold"), (False, 100, 100, "refuse")],
)  # fmt: skip
def test_a_request_is_forwarded_held_or_refused(ready, held, limit, verdict) -> None:
    assert admit(ready, held, limit) == verdict


def test_the_activator_only_ever_moves_zero_to_one() -> None:
    at_zero = {"metadata": {"resourceVersion": "41"}, "spec": {"replicas": 0}}
    assert scale_up_patch(at_zero) == {
        "metadata": {"resourceVersion": "41"},
        "spec": {"replicas": 1},
    }
    assert scale_up_patch({"metadata": {"resourceVersion": "41"}, "spec": {}}) is not None
    for replicas in (1, 2, 7):  # someone else (the autoscaler, a person) owns counts above 0
        assert scale_up_patch({"spec": {"replicas": replicas}}) is None


def test_refusals_are_openai_errors_a_client_can_act_on() -> None:
    full = queue_full_error(8)
    assert (full.status, full.code) == (503, "activator_queue_full")
    assert "8 requests are already waiting (--activator-queue-limit)" in full.message
    late = timeout_error(30, "scaling deployment ns/chat to 1: HTTP 403: forbidden")
    assert (late.status, late.code) == (503, "cold_start_timeout")
    assert "within 30 s" in late.message and "HTTP 403" in late.message
    assert f"retry after {RETRY_AFTER_S} s" in late.message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--activator-queue-limit", "0"], "activator_queue_limit: must be >= 1 request, got 0"),
        (["--cold-start-timeout", "0"], "cold_start_timeout: must be > 0 seconds, got 0.0"),
    ],
)
def test_bad_activator_flags_are_named(argv, message) -> None:
    args = _args("--upstream", "http://x:1", "--activate-deployment", "chat",
                 "--discover-namespace", "ns", *argv)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        activator_from_args(args)
    ok = activator_from_args(_args("--upstream", "http://x:1", "--activate-deployment", "chat",
                                   "--discover-namespace", "ns"))  # fmt: skip
    assert (ok.deployment, ok.namespace, ok.queue_limit, ok.timeout) == ("chat", "ns", 100, 300)


# --- against the emulator -------------------------------------------------------------------
def deployment(replicas: int) -> dict[str, Any]:
    labels = {"app.kubernetes.io/instance": "chat"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "default", "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "runtime", "image": "kvfleet:test"}]},
            },
        },
    }


def replicas(k8s) -> int:
    return k8s.get(DEPLOYMENT, "default", "chat")["spec"]["replicas"]


def activator_settings(url: str, **kw: Any) -> ActivatorSettings:
    return ActivatorSettings("chat", "default", api_server=url, token_file=None, ca_file=None, **kw)


class RouterUnderTest:
    """A router with discovery and the activator, served on a test port."""

    def __init__(self, kube_url: str, port: int, **activator: Any) -> None:
        discovery = PodDiscovery(
            DiscoverySettings(SELECTOR, "default", port, api_server=kube_url, interval=0.1,
                              token_file=None, ca_file=None)
        )  # fmt: skip
        settings = RouterSettings(scrape_interval=0.2, request_timeout=20.0)
        self.router = Router(ReplicaPool([]), settings, discovery,
                             activator_settings(kube_url, **activator))  # fmt: skip
        self.server = TestServer(self.router.app())

    async def __aenter__(self) -> RouterUnderTest:
        await self.server.start_server()
        self.base = str(self.server.make_url("")).rstrip("/")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def serving(kube_url: str, **activator: Any) -> AsyncIterator[tuple[list[str], Any, Any]]:
    """(pod IPs, RouterUnderTest, client session): a fake replica that listens on the first pod
    IP (it answers once discovery sees its pod Ready), and the router in front."""
    async with contextlib.AsyncExitStack() as stack:
        _, ips, port = await stack.enter_async_context(fakes_on_pod_ips("r0"))
        router = await stack.enter_async_context(RouterUnderTest(kube_url, port, **activator))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield ips, router, session


async def post(session: aiohttp.ClientSession, base: str) -> tuple[int, dict, dict]:
    async with session.post(f"{base}/v1/completions", json=BODY) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_a_request_at_zero_replicas_wakes_the_deployment_and_is_answered(kube) -> None:
    k8s = kube.emulator
    k8s.create_object(DEPLOYMENT, deployment(0))
    async with serving(kube.url) as (ips, r, s):
        # At zero the router stays healthy: it takes requests and holds them.
        async with s.get(f"{r.base}/health") as resp:
            assert resp.status == 200 and "activator holds" in (await resp.json())["status"]
        started = time.monotonic()
        request = asyncio.create_task(post(s, r.base))
        await eventually(lambda: replicas(k8s) == 1, timeout=5)
        managers = [f["manager"] for f in k8s.get(DEPLOYMENT, "default", "chat")["metadata"]
                    ["managedFields"]]  # fmt: skip
        assert FIELD_MANAGER in managers
        assert not request.done() and r.metric("kvfleet_router_held_requests") == 1
        await asyncio.sleep(0.5)  # the pod takes a while to be ready
        put_pod(k8s, "chat-0", ips[0], True)  # the kubelet: the new pod is Ready
        status, body, _ = await asyncio.wait_for(request, 10)
        # The activator's wake loop times the cold start when it next sees the replica ready,
        # which can come just after the held request it released is answered.
        await eventually(
            lambda: r.metric("kvfleet_router_cold_start_seconds_count") == 1, timeout=5
        )
        took = time.monotonic() - started
    assert status == 200 and body["served_by"] == "r0"
    assert r.metric("kvfleet_router_cold_starts_total") == 1
    assert r.metric("kvfleet_router_cold_start_seconds_count") == 1
    assert 0.5 <= r.metric("kvfleet_router_cold_start_seconds_sum") <= took
    assert r.metric("kvfleet_router_held_requests") == 0


async def test_the_hold_is_bounded_by_the_queue_limit_and_the_timeout(kube) -> None:
    k8s = kube.emulator
    k8s.create_object(DEPLOYMENT, deployment(0))
    async with serving(kube.url, queue_limit=1, timeout=1.0) as (_, r, s):
        first = asyncio.create_task(post(s, r.base))
        await eventually(lambda: r.metric("kvfleet_router_held_requests") == 1, timeout=5)
        status, body, headers = await post(s, r.base)  # the queue is full: at once
        assert (status, body["error"]["code"]) == (503, "activator_queue_full")
        assert headers["Retry-After"] == str(RETRY_AFTER_S)
        status, body, headers = await asyncio.wait_for(first, 5)  # no pod ever comes
    assert (status, body["error"]["code"]) == (503, "cold_start_timeout")
    assert "no replica became ready within 1 s" in body["error"]["message"]
    assert headers["Retry-After"] == str(RETRY_AFTER_S)
    assert replicas(k8s) == 1  # it did ask for one, once
    assert r.metric("kvfleet_router_activator_refused_total", reason="queue_full") == 1
    assert r.metric("kvfleet_router_activator_refused_total", reason="timeout") == 1
    assert r.metric("kvfleet_router_cold_start_seconds_count") == 0  # none became ready


async def test_replicas_above_zero_are_not_touched_the_request_waits_for_them(kube) -> None:
    k8s = kube.emulator
    k8s.create_object(DEPLOYMENT, deployment(2))  # scaled up, pods still starting
    async with serving(kube.url) as (ips, r, s):
        request = asyncio.create_task(post(s, r.base))
        await asyncio.sleep(1.5)
        assert not request.done() and replicas(k8s) == 2
        put_pod(k8s, "chat-0", ips[0], True)
        status, _, _ = await asyncio.wait_for(request, 10)
    assert status == 200 and replicas(k8s) == 2
    assert r.metric("kvfleet_router_cold_starts_total") == 0


async def test_a_scale_it_cannot_make_is_told_to_the_waiting_client(kube) -> None:
    # No Deployment of that name (or no RBAC): the API's answer is in the 503.
    async with serving(kube.url, timeout=1.5) as (_, r, s):
        status, body, _ = await post(s, r.base)
    assert (status, body["error"]["code"]) == (503, "cold_start_timeout")
    assert "reading the scale of deployment default/chat: HTTP 404" in body["error"]["message"]


async def test_a_scale_up_racing_the_activator_wins(kube) -> None:
    # The autoscaler (or a person) scales to 3 between the activator's read and its write: the
    # precondition fails (409), the activator reads again, finds 3 and leaves it.
    k8s = kube.emulator
    k8s.create_object(DEPLOYMENT, deployment(0))

    class Racing(ScaleClient):
        gets = 0

        async def _call(self, session, method, body=None):
            answer = await super()._call(session, method, body)
            if method == "GET" and self.gets == 0:
                k8s.mutate(DEPLOYMENT, "default", "chat", lambda d: d["spec"].update(replicas=3))
            self.gets += method == "GET"
            return answer

    client = Racing(activator_settings(kube.url))
    async with aiohttp.ClientSession() as s:
        assert await client.scale_from_zero(s) is False
    assert replicas(k8s) == 3 and client.gets == 2

"""`kvfleet router --discover-selector`: the replicas are the Ready pods a label selector
matches, listed from the API server (the repo's emulator here) while the router serves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fake_replica import FakeReplica
from kube_harness import POD, eventually, kube
from kvfleet.runtime.router.app import Router
from kvfleet.runtime.router.cmd_router import discovery_from_args, register
from kvfleet.runtime.router.discovery import (
    DiscoveryError,
    DiscoverySettings,
    PodDiscovery,
    api_server_url,
    ready_replica_urls,
)
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.settings import RouterSettings

__all__ = ["kube"]
pytestmark = pytest.mark.timeout(60)
SELECTOR = "app.kubernetes.io/instance=chat"


def pod(name: str, ip: str | None, ready: bool, instance: str = "chat", **meta: Any) -> dict:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"app.kubernetes.io/instance": instance},
            **meta,
        },
        "spec": {"containers": [{"name": "runtime", "image": "kvfleet:test"}]},
        "status": {"phase": "Running", "conditions": []},
    }
    if ip is not None:
        obj["status"]["podIP"] = ip
    obj["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return obj


def put_pod(k8s: Any, name: str, ip: str, ready: bool, instance: str = "chat") -> None:
    """Create the pod, or set its status as the kubelet would (status is not written on create)."""
    obj = pod(name, ip, ready, instance)
    if k8s.get(POD, "default", name) is None:
        k8s.create_object(POD, obj)
    k8s.mutate(POD, "default", name, lambda p: p.update(status=obj["status"]))


# --- pure ---------------------------------------------------------------------------------------
def test_only_ready_pods_with_an_ip_that_are_not_terminating_are_replicas() -> None:
    pods = {
        "items": [
            pod("a", "10.0.0.2", True),
            pod("b", "10.0.0.3", False),  # readiness probe failing: loading or draining
            pod("c", None, True),  # not scheduled yet
            pod("d", "10.0.0.5", True, deletionTimestamp="2026-01-01T00:00:00Z"),
            pod("e", "fd00::7", True),
            pod("f", "10.0.0.2", True),  # the same IP twice (host network): once
        ]
    }
    assert ready_replica_urls(pods, 8000) == ["http://10.0.0.2:8000", "http://[fd00::7]:8000"]
    with pytest.raises(DiscoveryError, match="no items"):
        ready_replica_urls({"kind": "Status"}, 8000)


def test_in_cluster_the_api_server_comes_from_the_service_env() -> None:
    s = DiscoverySettings(SELECTOR, "default", 8000)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert api_server_url(s, env) == "https://10.96.0.1:443"
    v6 = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert api_server_url(s, v6) == "https://[fd00::1]:443"
    with pytest.raises(DiscoveryError, match="--discover-api-server"):
        api_server_url(s, {})
    given = DiscoverySettings(SELECTOR, "default", 8000, api_server="http://127.0.0.1:9/")
    assert api_server_url(given, env) == "http://127.0.0.1:9"


def _args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["router", *argv])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--discover-selector", "a=b"], "discover-namespace: required outside a pod"),
        (
            ["--discover-selector", "a=b", "--upstream", "http://x:1", "--discover-namespace", "n"],
            "not both",
        ),
        (
            ["--discover-selector", "a=b", "--discover-namespace", "n", "--discover-port", "0"],
            "discover-port: must be in [1, 65535], got 0",
        ),
        (
            ["--discover-selector", "a=b", "--discover-namespace=n", "--discover-api-server=k:1"],
            "discover-api-server: give http(s)://host:port",
        ),
    ],
)
def test_bad_discovery_flags_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        discovery_from_args(_args(*argv))
    assert message in str(info.value)


def test_the_router_needs_upstreams_or_a_selector(capsys) -> None:
    from kvfleet.runtime.cli import main

    assert main(["router"]) == 2
    assert "--discover-selector" in capsys.readouterr().err


# --- against the emulator -----------------------------------------------------------------------
def _settings(url: str, **kw: Any) -> DiscoverySettings:
    return DiscoverySettings(
        SELECTOR, "default", 8000, api_server=url, token_file=None, ca_file=None, **kw
    )


async def test_the_pool_follows_the_selected_ready_pods_as_they_come_and_go(kube) -> None:
    k8s = kube.emulator
    put_pod(k8s, "chat-a", "10.0.0.2", True)
    put_pod(k8s, "chat-b", "10.0.0.3", False)
    put_pod(k8s, "other-a", "10.0.0.9", True, instance="other")
    changes: list[list[str]] = []
    discovery = PodDiscovery(_settings(kube.url), on_change=changes.append)
    pool = ReplicaPool([])
    async with aiohttp.ClientSession() as session:
        assert await discovery.sync(pool, session)
        assert [r.url for r in pool.replicas] == ["http://10.0.0.2:8000"]
        # chat-b's readiness probe passes, then chat-a is deleted (a scale-down).
        put_pod(k8s, "chat-b", "10.0.0.3", True)
        assert await discovery.sync(pool, session)
        assert [r.url for r in pool.replicas] == ["http://10.0.0.2:8000", "http://10.0.0.3:8000"]
        k8s.remove(POD, "default", "chat-a")
        assert await discovery.sync(pool, session)
        assert [r.url for r in pool.replicas] == ["http://10.0.0.3:8000"]
    assert changes == [
        ["http://10.0.0.2:8000"],
        ["http://10.0.0.2:8000", "http://10.0.0.3:8000"],
        ["http://10.0.0.3:8000"],
    ]


async def test_an_unreachable_api_server_keeps_the_known_replicas(kube, caplog) -> None:
    pool = ReplicaPool(["http://10.0.0.2:8000"])
    dead = PodDiscovery(_settings("http://127.0.0.1:9", timeout=2.0))
    async with aiohttp.ClientSession() as session:
        assert not await dead.sync(pool, session)
        assert not await dead.sync(pool, session)
        forbidden = PodDiscovery(
            DiscoverySettings(SELECTOR, "no such ns/..", 8000, api_server=kube.url)
        )
        with pytest.raises(DiscoveryError, match="listing pods"):
            await forbidden.poll(session)
    assert [r.url for r in pool.replicas] == ["http://10.0.0.2:8000"]
    assert dead.last_error.startswith("listing pods at http://127.0.0.1:9/api/v1/namespaces/")
    assert sum("replica discovery" in r.message for r in caplog.records) == 1  # once, not twice


@contextlib.asynccontextmanager
async def fakes_on_pod_ips(*names: str) -> AsyncIterator[tuple[list[FakeReplica], list[str], int]]:
    """Fake replicas on 127.0.0.2, 127.0.0.3, … all on one port, as pods on their own IPs."""
    from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips

    ips = pod_ips(len(names))
    port = choose_port(ips, preferred=0)
    fakes = [FakeReplica(n) for n in names]
    runners = []
    try:
        for fake, ip in zip(fakes, ips, strict=True):
            runner = web.AppRunner(fake.app())
            await runner.setup()
            await web.TCPSite(runner, ip, port).start()
            runners.append(runner)
            fake.url = f"http://{ip}:{port}"
        yield fakes, ips, port
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_router_with_discovery_serves_through_the_pods_it_found_and_finds_new_ones(
    kube,
) -> None:
    k8s = kube.emulator
    async with fakes_on_pod_ips("r0", "r1") as (fakes, ips, port):
        put_pod(k8s, "chat-0", ips[0], True)
        discovery = PodDiscovery(
            DiscoverySettings(
                SELECTOR, "default", port, api_server=kube.url, interval=0.1,
                token_file=None, ca_file=None,
            )
        )  # fmt: skip
        settings = RouterSettings(scrape_interval=0.1, request_timeout=20.0)
        router = Router(ReplicaPool([]), settings, discovery)
        server = TestServer(router.app())
        await server.start_server()
        base = str(server.make_url("")).rstrip("/")
        body = {"model": "fake", "prompt": "hello"}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, (await resp.text(), router.pool.replicas)
                    assert (await resp.json())["served_by"] == "r0"
                put_pod(k8s, "chat-1", ips[1], True)
                await eventually(lambda: all(r.healthy for r in router.pool.replicas)
                                 and len(router.pool.replicas) == 2, timeout=10)  # fmt: skip
                k8s.remove(POD, "default", "chat-0")
                await eventually(lambda: [r.url for r in router.pool.replicas] == [fakes[1].url])
                async with s.post(f"{base}/v1/completions", json=body) as resp:
                    assert (await resp.json())["served_by"] == "r1"
        finally:
            await server.close()

"""The operator test harness: the dev cluster's Kubernetes API server
(kvfleet.devcluster.apiserver) on 127.0.0.1 and the kvfleet operator on it, as fixtures and
helpers. It lives in tests/, the folder of tests/conftest.py, which pytest puts on the import
path, under its own module name, so every test folder can import it (`from kube_harness import
...`) without the clash of several `conftest` modules; the conftest.py of tests/operator,
tests/devcluster and tests/e2e expose its fixtures.

Reuse (e.g. an autoscaler end-to-end test):

    async def test_x(operator):              # kopf runs the operator's handlers, standalone
        k8s = operator.emulator               # devcluster/apiserver/emulator.py RealisticEmulator
        k8s.create_object(ISVC, sample("minimal"))
        await eventually(lambda: k8s.get(DEPLOYMENT, "default", "smollm2"))
        k8s.mutate(DEPLOYMENT, "default", "smollm2", lambda d: d["status"].update(...))

- `kube` — the emulator alone: RealisticEmulator with the operator's resources declared,
  served on 127.0.0.1 (`kube.url`), with KUBECONFIG pointing at it for the test.
- `operator` — `kube` plus kopf running `kvfleet.operator.handlers.build_registry()` in the
  test's event loop (explicit registry, clusterwide, standalone, scanning off). Its fields:
  `emulator`, `url`, `config` (OperatorConfig, pass `extra_registration` to add handlers).
  To add handlers of your own (an autoscaler timer), request `operator_registration` by
  overriding it: a fixture returning a callable `(registry, config) -> None`.
- `eventually(predicate, timeout=...)` (a helper, not a fixture): polls until truthy.

Every server and watch is bounded: watches end after emulator_reads.WATCH_SECONDS, and the
fixture closes them before stopping the server.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.test_utils
import kmock
import pytest
import yaml
from kvfleet.devcluster.apiserver.emulator import RealisticEmulator

ROOT = pathlib.Path(__file__).resolve().parents[1]
ISVC = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOYMENT = "apps/v1/deployments"
SERVICE = "v1/services"
POD = "v1/pods"


def sample(name: str) -> dict[str, Any]:
    """A sample InferenceService from manifests/samples/<name>.yaml."""
    return yaml.safe_load((ROOT / "manifests" / "samples" / f"{name}.yaml").read_text())


async def eventually(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05
) -> Any:
    """Poll `predicate` until it returns something truthy; fail with its last value on timeout."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {value!r})")


LEASE = "coordination.k8s.io/v1/leases"
# Leader election's Lease (operator/leader_election.py): get, create and update are what the
# operator's Role allows; list, watch and delete are for tests and kubectl.
LEASE_INFO = kmock.ResourceInfo(
    kind="Lease",
    namespaced=True,
    verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
)


@dataclass(slots=True)
class Kube:
    """The running emulator and its URL."""

    emulator: RealisticEmulator
    url: str


@dataclass(slots=True)
class RunningOperator:
    """The emulator with the operator running against it."""

    emulator: RealisticEmulator
    url: str
    config: Any  # kvfleet.operator.handlers.OperatorConfig


@pytest.fixture
async def kube(tmp_path, monkeypatch) -> AsyncIterator[Kube]:
    emulator = RealisticEmulator()  # validates at the chart's minimum Kubernetes
    emulator.declare_core()
    # Short keep-alive: kopf waits (up to 5 s) at exit for every task started after it,
    # idle server connections included.
    server_cls = functools.partial(aiohttp.test_utils.RawTestServer, keepalive_timeout=0.2)
    emulator.resources[LEASE] = LEASE_INFO
    async with emulator, kmock.Server(emulator, server_cls=server_cls) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": url}}],
                    "users": [{"name": "emu", "user": {"token": "test-token"}}],
                    "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}],
                    "current-context": "emu",
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        try:
            yield Kube(emulator, url)
        finally:
            emulator.close_watches()


@pytest.fixture
def operator_registration() -> Callable[[Any, Any], None] | None:
    """Override to register extra handlers on the operator's registry: fn(registry, config)."""
    return None


@pytest.fixture
async def operator(kube: Kube, operator_registration) -> AsyncIterator[RunningOperator]:
    from kvfleet.operator.handlers import OperatorConfig, build_registry
    from kvfleet.operator.kopf_thread import start_kopf_thread
    from kvfleet.operator.kube_api import KubeApi

    config = OperatorConfig(api=KubeApi.from_environment())
    registry = build_registry(config)
    if operator_registration is not None:
        operator_registration(registry, config)
    logging.getLogger("kopf").setLevel(logging.INFO)
    running = start_kopf_thread(registry)
    try:
        await eventually(running.ready.is_set, timeout=15)
        yield RunningOperator(kube.emulator, kube.url, config)
    finally:
        running.stop.set()
        kube.emulator.close_watches()
        config.api.api_client.rest_client.pool_manager.clear()
        await eventually(lambda: not running.thread.is_alive(), timeout=15)


def deployment_available(replicas: int | None = None) -> Callable[[dict[str, Any]], None]:
    """A change that makes a Deployment report what its controller would once pods are ready."""

    def change(dep: dict[str, Any]) -> None:
        n = dep["spec"]["replicas"] if replicas is None else replicas
        dep["status"] = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
            ],
        }

    return change


def isvc_with(name: str = "chat", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """A minimal InferenceService with spec fields replaced by `spec`."""
    obj = copy.deepcopy(sample("minimal"))
    obj["metadata"] = {"name": name, "namespace": namespace}
    obj["spec"].update(spec)
    return obj

"""`kvfleet operator` processes started the way the chart runs them, against the emulator: the
chart's own args and env, the Downward API filled in as the kubelet would, and a kubeconfig
with a bearer token of their own, so the emulator's request log says who did what.

The `cluster` fixture (exposed by tests/operator/conftest.py) holds the emulator and the
processes started on it, and kills whatever still runs at the end, printing each one's log.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kmock
import pytest
import yaml
from kube_harness import LEASE, ROOT, Kube

RELEASE, RELEASE_NS = "kvfleet", "kvfleet-system"
WRITES = {"POST", "PUT", "PATCH", "DELETE"}


def chart_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders with `values` (NOTES.txt left out)."""
    with helm.Chart.load(ROOT / "charts" / "kvfleet") as chart:
        rendered = chart.render(values, name=RELEASE, namespace=RELEASE_NS)
    return [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def chart_operator(values: dict[str, Any]) -> tuple[list[str], list[dict], list[dict]]:
    """The operator container's args and env, and every object, as the chart renders them."""
    return _operator(chart_objects(values))


def kustomize_operator() -> tuple[list[str], list[dict], list[dict]]:
    """The same from the kustomize install, as `kubectl kustomize manifests` builds it."""
    built = subprocess.run(
        [Path(sys.executable).parent / "kubectl", "kustomize", str(ROOT / "manifests")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return _operator([doc for doc in yaml.safe_load_all(built) if doc])


def _operator(objects: list[dict]) -> tuple[list[str], list[dict], list[dict]]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"], container.get("env", []), objects


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_args(args: list[str]) -> list[str]:
    """The chart's args with the ports made free: the replicas share one host here (a pod
    each in a cluster)."""
    out = []
    for arg in args:
        if arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{free_port()}/healthz"
        elif arg.startswith("--metrics-port="):
            arg = "--metrics-port=0"
        out.append(arg)
    return out


def lease_name(args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith("--lease-name="))


@dataclass(slots=True)
class Replica:
    """One operator process, as one pod of the chart's Deployment."""

    pod: str
    token: str
    process: asyncio.subprocess.Process
    log: Path

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@dataclass(slots=True)
class Cluster:
    """The emulator and the operator replicas started against it."""

    kube: Kube
    tmp: Path
    replicas: list[Replica]

    async def start(self, pod: str, args: list[str], env: list[dict]) -> Replica:
        token = f"token-{pod}"
        kubeconfig = self.tmp / f"kubeconfig-{pod}"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "emu", "cluster": {"server": self.kube.url}}],
                    "users": [{"name": pod, "user": {"token": token}}],
                    "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": pod}}],
                    "current-context": "emu",
                }
            )
        )
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        environ.update(KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
        # The Downward API, as the kubelet would fill it for this pod.
        fields = {"metadata.name": pod, "metadata.namespace": RELEASE_NS}
        for var in env:
            ref = (var.get("valueFrom") or {}).get("fieldRef")
            environ[var["name"]] = fields[ref["fieldPath"]] if ref else var["value"]
        log = self.tmp / f"{pod}.log"
        process = await asyncio.create_subprocess_exec(
            Path(sys.executable).parent / "kvfleet",
            *local_args(args),
            env=environ,
            stdout=log.open("wb"),
            stderr=asyncio.subprocess.STDOUT,
        )
        replica = Replica(pod, token, process, log)
        self.replicas.append(replica)
        return replica

    def requests_by(self, replica: Replica) -> list[kmock.Request]:
        auth = f"Bearer {replica.token}"
        return [r for r in list(self.kube.emulator) if r.headers.get("Authorization") == auth]

    def writes_by(self, replica: Replica) -> list[str]:
        """The writes this replica made, as "METHOD path", its Lease excepted."""
        return [
            f"{r.method.value} {r.url.path}"
            for r in self.requests_by(replica)
            if r.method.value in WRITES and "/leases" not in r.url.path
        ]

    def holder(self, lease: str) -> str:
        obj = self.kube.emulator.get(LEASE, RELEASE_NS, lease) or {}
        return (obj.get("spec") or {}).get("holderIdentity") or ""


@pytest.fixture
async def cluster(kube: Kube, tmp_path: Path) -> AsyncIterator[Cluster]:
    running = Cluster(kube, tmp_path, [])
    try:
        yield running
    finally:
        for replica in running.replicas:
            if replica.process.returncode is None:
                replica.process.kill()
                await replica.process.wait()
        for replica in running.replicas:
            print(f"--- {replica.pod} (exit {replica.process.returncode})\n{replica.tail()}")

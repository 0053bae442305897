"""Several `kvfleet operator` processes against one API server, as the chart runs them with
replicas > 1: exactly one acts, the others only watch their Lease; when the active one is
killed, stopped or loses its Lease, another takes over within the stated bound.

Each process has its own bearer token, so the emulator's request log says who did what.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import kmock
import pytest
import yaml
from kube_harness import DEPLOYMENT, ISVC, LEASE, ROOT, Kube, eventually, isvc_with
from kvfleet.operator.leader_election import LeaseTiming, micro_time

RELEASE, RELEASE_NS = "kvfleet", "kvfleet-system"
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
# Short enough for a test, the same shape as the defaults (15 / 10 / 2).
FAST = LeaseTiming(lease_duration=3, renew_deadline=2.0, retry_period=0.5).check()
FAST_FLAGS = [
    f"--lease-duration={FAST.lease_duration}",
    f"--renew-deadline={FAST.renew_deadline}",
    f"--retry-period={FAST.retry_period}",
]
# What a fresh process needs before its first Lease request (imports, kopf start-up), on a
# loaded 2-core machine.
STARTUP_SLACK = 6.0


def chart_operator(values: dict) -> tuple[list[str], list[dict], list[dict]]:
    """The operator container's args and env, and every object, as the chart renders them."""
    with helm.Chart.load(ROOT / "charts" / "kvfleet") as chart:
        rendered = chart.render(values, name=RELEASE, namespace=RELEASE_NS)
    objects = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"], container.get("env", []), objects


def install_chart_resources(kube: Kube, objects: list[dict]) -> None:
    """What `helm install` would add to the API server that the operator talks to: the
    resources of the CustomResourceDefinitions it renders, and their objects."""
    kinds = {}
    for crd in (o for o in objects if o["kind"] == "CustomResourceDefinition"):
        spec = crd["spec"]
        for version in spec["versions"]:
            path = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
            kube.emulator.resources[path] = kmock.ResourceInfo(
                kind=spec["names"]["kind"],
                namespaced=spec["scope"] == "Namespaced",
                subresources={"status"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
            kinds[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = path
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in kinds:
            kube.emulator.create_object(kinds[obj["apiVersion"], obj["kind"]], obj)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
async def cluster(kube, tmp_path) -> AsyncIterator[Cluster]:
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


def deployment(kube: Kube, name: str) -> Callable[[], object]:
    return lambda: kube.emulator.get(DEPLOYMENT, "default", name)


async def test_chart_with_two_replicas_has_exactly_one_acting(cluster):
    """The chart's own args and env for replicas=2, run as two processes: one reconciles and
    autoscales, the other touches nothing but its Lease. (With kopf peering, both paused.)"""
    args, env, objects = chart_operator({"replicas": 2})
    install_chart_resources(cluster.kube, objects)
    first = await cluster.start("kvfleet-a", args, env)
    second = await cluster.start("kvfleet-b", args, env)
    autoscaled = {"enabled": True, "pollIntervalSeconds": 1}
    cluster.kube.emulator.create_object(ISVC, isvc_with("chat", autoscaling=autoscaled))

    await eventually(deployment(cluster.kube, "chat"), timeout=20)
    await asyncio.sleep(3)  # a few autoscaler polls and reconciles, and as many chances to err
    acting = [r for r in (first, second) if cluster.writes_by(r)]
    assert len(acting) == 1, {r.pod: cluster.writes_by(r) for r in (first, second)}
    (leader,) = acting
    (standby,) = [r for r in (first, second) if r is not leader]
    assert cluster.holder(lease_name(args)).startswith(f"{leader.pod}_")
    # The standby runs no kopf at all: it touches nothing but its Lease (a POST to the
    # collection when both raced to create it and the other won).
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NS}/leases"
    touched = {r.url.path for r in cluster.requests_by(standby)}
    assert touched and touched <= {leases, f"{leases}/{lease_name(args)}"}, touched
    # Only the leader's autoscaler polls: it lists the InferenceService's pods.
    polls = [r for r in cluster.requests_by(leader) if r.url.path.endswith("/pods")]
    assert len(polls) >= 2
    assert standby.process.returncode is None  # waiting, not crashed


async def fast_pair(cluster: Cluster) -> tuple[Replica, Replica, str]:
    """Two replicas with short Lease timings; the first started is the leader."""
    args, env, _ = chart_operator({"replicas": 2})
    args = args + FAST_FLAGS
    lease = lease_name(args)
    leader = await cluster.start("kvfleet-a", args, env)
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-a_"), timeout=15)
    standby = await cluster.start("kvfleet-b", args, env)
    # The standby is up once it has read the Lease.
    await eventually(lambda: cluster.requests_by(standby), timeout=15)
    cluster.kube.emulator.create_object(ISVC, isvc_with("one"))
    await eventually(deployment(cluster.kube, "one"), timeout=15)
    return leader, standby, lease


async def test_killed_leader_is_replaced_within_the_lease_bound(cluster):
    leader, standby, lease = await fast_pair(cluster)
    await asyncio.sleep(FAST.retry_period)  # the standby has seen a recent renewal
    leader.process.send_signal(signal.SIGKILL)  # no release, no goodbye
    killed = time.monotonic()
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))

    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    took_lease = time.monotonic() - killed
    await eventually(deployment(cluster.kube, "two"), timeout=15)
    acted = time.monotonic() - killed
    print(f"SIGKILL: lease taken after {took_lease:.2f}s, acting after {acted:.2f}s "
          f"(bound {FAST.takeover_bound:g}s + kopf start-up)")  # fmt: skip
    assert took_lease >= FAST.lease_duration - FAST.retry_period  # it waited out the lease
    assert took_lease <= FAST.takeover_bound + 1.0  # + scheduling on a busy machine
    assert acted <= FAST.takeover_bound + STARTUP_SLACK
    # (children are server-side applied: a PATCH creates them)
    assert "PATCH /apis/apps/v1/namespaces/default/deployments/two" in cluster.writes_by(standby)
    # The standby wrote nothing before it held the lease: its first write is after the kill.
    lease_obj = cluster.kube.emulator.get(LEASE, RELEASE_NS, lease)
    assert lease_obj["spec"]["leaseTransitions"] == 1


async def test_stopped_leader_hands_over_at_once(cluster):
    leader, _, lease = await fast_pair(cluster)
    leader.process.send_signal(signal.SIGTERM)  # a rollout or a drained node
    stopped = time.monotonic()
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    took = time.monotonic() - stopped
    print(f"SIGTERM: lease taken after {took:.2f}s")
    assert await asyncio.wait_for(leader.process.wait(), timeout=15) == 0
    # Released, not expired: well within a lease duration (kopf's own shutdown comes first).
    assert took < FAST.lease_duration
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))
    await eventually(deployment(cluster.kube, "two"), timeout=STARTUP_SLACK + 5)


async def test_leader_that_loses_its_lease_exits_before_the_new_holder_acts(cluster):
    leader, standby, lease = await fast_pair(cluster)

    def taken(obj: dict) -> None:  # another holder, as after a partition healed
        obj["spec"].update(holderIdentity="elsewhere", renewTime=micro_time())

    cluster.kube.emulator.mutate(LEASE, RELEASE_NS, lease, taken)
    lost = time.monotonic()
    assert await asyncio.wait_for(leader.process.wait(), timeout=10) == 1
    print(f"lease taken away: leader exited after {time.monotonic() - lost:.2f}s")
    assert time.monotonic() - lost <= 2 * FAST.retry_period + 1.0
    assert "lost the lease" in leader.log.read_text()
    # Nobody renews "elsewhere": the standby takes over once it expires, and acts.
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))
    await eventually(deployment(cluster.kube, "two"), timeout=STARTUP_SLACK + 5)
    assert standby.process.returncode is None

"""A stand-in for the kubelet and the Deployment controller: real runtime processes as pods.

Used by the autoscaling end-to-end test and `kvfleet demo autoscale`, against an API server
with no nodes (the test emulator). It polls the Deployments of one namespace and, for each
wanted replica, starts a real `kvfleet serve` process from the pod template's container args,
bound to its own loopback address (127.0.0.2, 127.0.0.3, …), like a pod IP. It writes the Pod
objects (template labels, an ownerReference to the Deployment, podIP, a Ready condition once
/health answers 200) and the Deployment's status.

Scale-down follows a real kubelet's graceful termination: the Pod is deleted (it carries a
finalizer, so it stays, with a deletionTimestamp, while it terminates) and marked not ready so
no new request is routed to it; after the preStop pause the process gets SIGTERM and drains;
only when it has exited is the finalizer removed and the Pod gone.

Port: every pod listens on the same port, contract.RUNTIME_PORT (8000) when that is free on all
the addresses the simulator may use, else one free port chosen at start (`KubeletSim.port`);
the autoscaler must then be told: OperatorConfig.extra[autoscale_loop.RUNTIME_PORT_SETTING].

Bounded: at most `max_pods` processes; `stop()` (or leaving `async with`) SIGTERMs every
process, SIGKILLs those still running after `stop_timeout`, and removes their Pod objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kvfleet.operator.kube_api import DEPLOYMENTS, PODS, KubeApi, KubeApiError
from kvfleet.operator.metrics_source import MetricsParseError, parse_runtime_metrics

from kvfleet import contract

log = logging.getLogger("kvfleet.kubelet_sim")

FINALIZER = "kvfleet.dev/kubelet-sim"
# util-linux's setpriv makes the kernel SIGKILL a runtime process whose parent dies without
# cleaning up (a killed test run): no orphaned servers. Without it, stop() is the guarantee.
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
FIRST_IP = 2  # 127.0.0.1 stays the API server's and the load's
NODE_NAME = "kubelet-sim"


def pod_ips(count: int) -> list[str]:
    """The loopback addresses the simulator hands out as pod IPs."""
    if not 1 <= count <= 250:
        raise ValueError(f"max_pods: must be in 1..250, got {count}")
    return [f"127.0.0.{FIRST_IP + i}" for i in range(count)]


def choose_port(hosts: Sequence[str], preferred: int = contract.RUNTIME_PORT) -> int:
    """`preferred` when it can be bound on every host, else a port free on all of them."""

    def free_everywhere(port: int) -> bool:
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            return False
        return True

    if free_everywhere(preferred):
        return preferred
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if free_everywhere(port):
            return port
    raise RuntimeError(f"no TCP port is free on all of {', '.join(hosts)}")


def serve_command(
    container: Mapping[str, Any], host: str, port: int, python: str = sys.executable
) -> list[str]:
    """The process for a pod's runtime container: its args, with the pod's address and port.

    `command: [kvfleet]` becomes this interpreter's `-m kvfleet.runtime.cli` (the same
    installation, no PATH lookup); `--host`/`--port` are what the pod network would provide.
    """
    args = list(container.get("args") or [])
    if not args or args[0] != "serve":
        raise ValueError(f"container {container.get('name')!r} does not run `kvfleet serve`")
    for flag, value in (("--host", host), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return [python, "-m", "kvfleet.runtime.cli", *args]


@dataclass(slots=True, frozen=True)
class PodEvent:
    """Something that happened to a simulated pod (for timelines and test assertions)."""

    at: float  # time.time()
    pod: str
    ip: str
    what: str  # started, ready, terminating, exited, crashed
    detail: str = ""


@dataclass(slots=True)
class SimPod:
    """One runtime process playing a pod."""

    name: str
    deployment: str
    ip: str
    process: asyncio.subprocess.Process
    log_path: Path
    grace_seconds: float
    prestop_seconds: float
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    terminating: bool = False
    crashed: bool = False
    in_flight_at_sigterm: float | None = None
    exit_code: int | None = None


@dataclass(slots=True)
class KubeletSim:
    """Plays kubelet + Deployment controller for the Deployments of `namespace`."""

    api: KubeApi
    namespace: str
    log_dir: Path
    max_pods: int = 4
    poll_seconds: float = 0.2
    prestop_cap_seconds: float = 1.0  # the template's preStop sleep, capped: tests are short
    stop_timeout: float = 30.0
    python: str = sys.executable
    port: int = 0  # 0: choose at start (see choose_port)
    pods: dict[str, SimPod] = field(default_factory=dict)
    events: list[PodEvent] = field(default_factory=list)
    _ips: list[str] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _stopping: set[asyncio.Task[None]] = field(default_factory=set)
    _session: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self._ips = pod_ips(self.max_pods)
        if not self.port:
            self.port = choose_port(self._ips)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # --- public -------------------------------------------------------------------------
    async def __aenter__(self) -> KubeletSim:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        """Start watching Deployments (a task in the running event loop)."""
        self._session = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._run(), name="kubelet-sim")

    def endpoints(self, deployment: str | None = None) -> list[str]:
        """Base URLs of ready, not terminating pods: what a Service would route to."""
        return [
            f"http://{p.ip}:{self.port}"
            for p in sorted(self.pods.values(), key=lambda p: p.name)
            if p.ready and not p.terminating and deployment in (None, p.deployment)
        ]

    def active(self, deployment: str | None = None) -> list[SimPod]:
        """Pods that count toward a Deployment's replicas (not terminating)."""
        return [
            p
            for p in self.pods.values()
            if not p.terminating and deployment in (None, p.deployment)
        ]

    async def stop(self) -> None:
        """Stop watching, SIGTERM every process (SIGKILL after stop_timeout), remove the Pods."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for pod in list(self.pods.values()):
            if not pod.terminating:
                self._begin_termination(pod, prestop=False)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        for pod in list(self.pods.values()):  # anything a failed termination left behind
            await self._kill(pod)
            self.pods.pop(pod.name, None)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def raise_on_task_error(self) -> None:
        """Raise what stopped the watch loop, if it stopped on an error."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise RuntimeError("kubelet simulator stopped") from error

    # --- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._sync()
            except KubeApiError as exc:
                log.warning("kubelet-sim: API error, retrying: %s", exc)
            await asyncio.sleep(self.poll_seconds)

    async def _sync(self) -> None:
        deployments = await asyncio.to_thread(self.api.list, DEPLOYMENTS, self.namespace)
        wanted = {d["metadata"]["name"]: d for d in deployments}
        # Pods whose Deployment is gone (garbage collection) or whose object was deleted.
        live = {
            p["metadata"]["name"]: p
            for p in await asyncio.to_thread(self.api.list, PODS, self.namespace)
        }
        for pod in list(self.pods.values()):
            obj = live.get(pod.name)
            gone = pod.deployment not in wanted or obj is None
            deleted = obj is not None and obj["metadata"].get("deletionTimestamp")
            if not pod.terminating and (gone or deleted):
                self._begin_termination(pod, prestop=True)
        for name, deployment in wanted.items():
            await self._sync_deployment(name, deployment)

    async def _sync_deployment(self, name: str, deployment: Mapping[str, Any]) -> None:
        want = int((deployment.get("spec") or {}).get("replicas", 1))
        active = self.active(name)
        for _ in range(want - len(active)):
            if len(self.pods) >= self.max_pods:
                log.warning(
                    "kubelet-sim: %s wants %d pods; at most %d run", name, want, self.max_pods
                )
                break
            await self._start_pod(deployment)
        if len(active) > want:
            # A ReplicaSet removes pods that are not ready first, then the newest.
            victims = sorted(active, key=lambda p: (p.ready, -p.started))
            for pod in victims[: len(active) - want]:
                self._begin_termination(pod, prestop=True)
        for pod in self.active(name):
            await self._check(pod)
        await self._write_deployment_status(deployment)

    # --- pods ---------------------------------------------------------------------------
    async def _start_pod(self, deployment: Mapping[str, Any]) -> None:
        meta = deployment["metadata"]
        template = copy.deepcopy(deployment["spec"]["template"])
        container = template["spec"]["containers"][0]
        used = {p.ip for p in self.pods.values()}
        ip = next(i for i in self._ips if i not in used)
        name = f"{meta['name']}-{uuid.uuid4().hex[:5]}"
        command = serve_command(container, ip, self.port, self.python)
        launch = [*_DIE_WITH_PARENT, *command]
        prestop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
        grace = float(template["spec"].get("terminationGracePeriodSeconds") or 30)
        pod_obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": dict(template["metadata"].get("labels") or {}),
                "annotations": dict(template["metadata"].get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
                "finalizers": [FINALIZER],
            },
            "spec": {**template["spec"], "nodeName": NODE_NAME},
        }
        await asyncio.to_thread(self.api.create, PODS, self.namespace, pod_obj)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                *launch,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        pod = SimPod(
            name=name,
            deployment=meta["name"],
            ip=ip,
            process=process,
            log_path=log_path,
            grace_seconds=grace,
            prestop_seconds=min(float(prestop.get("seconds") or 0), self.prestop_cap_seconds),
        )
        self.pods[name] = pod
        self._event(pod, "started", " ".join(command[3:]))
        await self._write_pod_status(pod)

    async def _check(self, pod: SimPod) -> None:
        """Readiness probe and crash detection for a running pod."""
        code = pod.process.returncode
        if code is not None and not pod.crashed:
            # Not asked to stop: report it like CrashLoopBackOff would, and do not restart
            # (a test wants to see the crash, not a loop of them).
            pod.crashed, pod.ready, pod.exit_code = True, False, code
            self._event(pod, "crashed", f"exit code {code}; log {pod.log_path}")
            await self._write_pod_status(pod)
            return
        if pod.ready or pod.crashed:
            return
        assert self._session is not None
        try:
            url = f"http://{pod.ip}:{self.port}{contract.HEALTH_PATH}"
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                healthy = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        if healthy:
            pod.ready = True
            self._event(pod, "ready")
            await self._write_pod_status(pod)

    def _begin_termination(self, pod: SimPod, prestop: bool) -> None:
        pod.terminating = True
        self._event(pod, "terminating")
        task = asyncio.create_task(self._terminate(pod, prestop), name=f"stop-{pod.name}")
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _terminate(self, pod: SimPod, prestop: bool) -> None:
        try:
            # Deleting starts graceful termination; the finalizer keeps the object meanwhile.
            with contextlib.suppress(KubeApiError):
                await asyncio.to_thread(
                    self.api.request, "DELETE", self.api.path(PODS, self.namespace, pod.name)
                )
            await self._write_pod_status(pod)
            if prestop and pod.prestop_seconds:
                await asyncio.sleep(pod.prestop_seconds)
            pod.in_flight_at_sigterm = await self._in_flight(pod)
            if pod.process.returncode is None:
                pod.process.send_signal(signal.SIGTERM)
            timeout = min(pod.grace_seconds, self.stop_timeout)
            try:
                pod.exit_code = await asyncio.wait_for(pod.process.wait(), timeout)
            except TimeoutError:
                await self._kill(pod)
            self._event(pod, "exited", f"exit code {pod.exit_code}")
            with contextlib.suppress(KubeApiError):
                await asyncio.to_thread(
                    self.api.request,
                    "PATCH",
                    self.api.path(PODS, self.namespace, pod.name),
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                )
        finally:
            await self._kill(pod)  # only does something when cancelled or failed
            self.pods.pop(pod.name, None)

    async def _kill(self, pod: SimPod) -> None:
        if pod.process.returncode is None:
            pod.process.kill()
            pod.exit_code = await pod.process.wait()
            self._event(pod, "killed", f"still running after {self.stop_timeout:g}s")

    async def _in_flight(self, pod: SimPod) -> float | None:
        """Requests running or queued on the pod just before SIGTERM (what the drain covers)."""
        if not pod.ready or self._session is None:
            return None
        url = f"http://{pod.ip}:{self.port}{contract.METRICS_PATH}"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                load = parse_runtime_metrics(await r.text())
        except (aiohttp.ClientError, TimeoutError, MetricsParseError):
            return None
        return load.running + load.waiting

    # --- objects ------------------------------------------------------------------------
    async def _write_pod_status(self, pod: SimPod) -> None:
        ready = pod.ready and not pod.terminating
        if pod.crashed:
            state: dict[str, Any] = {"terminated": {"exitCode": pod.exit_code, "reason": "Error"}}
        else:
            state = {"running": {"startedAt": _rfc3339()}}
        status = {
            "phase": "Failed" if pod.crashed else "Running",
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"},
                {"type": "ContainersReady", "status": "True" if ready else "False"},
            ],
            "containerStatuses": [
                {
                    "name": "runtime",
                    "ready": ready,
                    "started": not pod.crashed,
                    "state": state,
                    "restartCount": 0,
                }
            ],
        }
        with contextlib.suppress(KubeApiError):  # the pod may be gone already
            await asyncio.to_thread(self.api.patch_status, PODS, self.namespace, pod.name, status)

    async def _write_deployment_status(self, deployment: Mapping[str, Any]) -> None:
        name = deployment["metadata"]["name"]
        active = self.active(name)
        ready = sum(1 for p in active if p.ready)
        want = int((deployment.get("spec") or {}).get("replicas", 1))
        available = "True" if ready >= want else "False"
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": len(active),
            "updatedReplicas": len(active),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": available,
                    "reason": "MinimumReplicasAvailable"
                    if available == "True"
                    else "MinimumReplicasUnavailable",
                }
            ],
        }
        old = deployment.get("status") or {}
        if all(old.get(k) == v for k, v in status.items()):
            return
        with contextlib.suppress(KubeApiError):
            await asyncio.to_thread(
                self.api.patch_status, DEPLOYMENTS, self.namespace, name, status
            )

    def _event(self, pod: SimPod, what: str, detail: str = "") -> None:
        self.events.append(PodEvent(time.time(), pod.name, pod.ip, what, detail))
        log.info("kubelet-sim: pod %s (%s) %s %s", pod.name, pod.ip, what, detail)


def _rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

"""A stand-in for the kubelet and the Deployment controller: real runtime processes as pods.

Used by the end-to-end tests and `kvfleet demo autoscale`, against an API server with no nodes
(the test emulator). It polls the Deployments of one namespace and, for each wanted replica,
starts a real `kvfleet serve` process from the pod template's container args, bound to its own
loopback address (127.0.0.2, 127.0.0.3, …), like a pod IP. It writes the Pod objects (template
labels, an ownerReference to the Deployment, podIP, a Ready condition once /health answers 200)
and the Deployment's status. Volumes, paths and env are translated to the host as
container_process.py says.

Init containers (`kvfleet download` for hf:// models) run first, one after the other, each to
completion: meanwhile the Pod is Pending with `initContainerStatuses`. One that exits non-zero
fails the pod as a kubelet would show it (init container waiting in CrashLoopBackOff, its last
exit code and log tail as the termination message, a Warning Event on the Pod) but is not
restarted: a test wants to see the failure, not a loop of them. A Secret or key the env needs
that is missing is a CreateContainerConfigError the same way. Then the main container starts.

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
from kvfleet.operator.container_process import (
    ContainerConfigError,
    container_env,
    host_path,
    kvfleet_command,
    mount_table,
    termination_message,
    volume_folders,
)
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
SECRETS = ("", "v1", "secrets")
CONFIGMAPS = ("", "v1", "configmaps")
EVENTS = ("", "v1", "events")


def pod_ips(count: int) -> list[str]:
    """The loopback addresses the simulator hands out as pod IPs."""
    if not 1 <= count <= 250:
        raise ValueError(f"max_pods: must be in 1..250, got {count}")
    return [f"127.0.0.{FIRST_IP + i}" for i in range(count)]


def choose_port(hosts: Sequence[str], preferred: int = contract.RUNTIME_PORT) -> int:
    """`preferred` when it can be bound on every host, else a port free on all of them
    (`preferred` 0: any free port, away from 8000 where other runs on the host may be)."""

    def free_everywhere(port: int) -> bool:
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            return False
        return True

    if preferred and free_everywhere(preferred):
        return preferred
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if free_everywhere(port):
            return port
    raise RuntimeError(f"no TCP port is free on all of {', '.join(hosts)}")


def serve_command(
    container: Mapping[str, Any],
    host: str,
    port: int,
    python: str = sys.executable,
    api_server: str | None = None,
) -> list[str]:
    """The process for a pod's main container, `kvfleet serve` or `kvfleet router`: its args,
    with the pod's address and port.

    `command: [kvfleet]` becomes this interpreter's `-m kvfleet.runtime.cli` (the same
    installation, no PATH lookup); `--host`/`--port` are what the pod network would provide.
    A router that discovers its replicas is pointed at `api_server` (a real kubelet gives
    the pod KUBERNETES_SERVICE_HOST/PORT and a token instead) and at the one port every
    simulated pod serves on.
    """
    args = list(container.get("args") or [])
    if not args or args[0] not in ("serve", "router"):
        raise ValueError(
            f"container {container.get('name')!r} runs neither `kvfleet serve` nor `kvfleet router`"
        )
    replaced = [("--host", host), ("--port", str(port))]
    if args[0] == "router" and "--discover-selector" in args:
        replaced.append(("--discover-port", str(port)))
        if api_server is not None:
            replaced.append(("--discover-api-server", api_server))
    for flag, value in replaced:
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return kvfleet_command({**container, "command": ["kvfleet"], "args": args}, python)


@dataclass(slots=True, frozen=True)
class PodEvent:
    """Something that happened to a simulated pod (for timelines and test assertions)."""

    at: float  # time.time()
    pod: str
    ip: str
    # initializing, init-started, init-done, init-failed, config-error, started, ready,
    # terminating, exited, crashed, killed
    what: str
    detail: str = ""


@dataclass(slots=True, frozen=True)
class Waiting:
    """A container that cannot run: why, as the kubelet's waiting state and last exit say."""

    container: str
    reason: str  # CrashLoopBackOff, CreateContainerConfigError
    message: str
    exit_code: int | None = None  # of the failed run, for CrashLoopBackOff
    log_tail: str = ""


@dataclass(slots=True)
class SimPod:
    """One pod: its init containers' processes in turn, then the runtime process."""

    name: str
    deployment: str
    ip: str
    template: dict[str, Any]
    log_path: Path
    grace_seconds: float
    prestop_seconds: float
    volumes: dict[str, Path] = field(default_factory=dict)  # translated volumes, by name
    uid: str = ""
    process: asyncio.subprocess.Process | None = None  # the main container, once started
    init_names: tuple[str, ...] = ()
    init_done: int = 0  # init containers that completed
    init_process: asyncio.subprocess.Process | None = None
    init_task: asyncio.Task[None] | None = None
    waiting: Waiting | None = None  # set when a container failed to start or init failed
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    terminating: bool = False
    crashed: bool = False
    in_flight_at_sigterm: float | None = None
    exit_code: int | None = None

    @property
    def initializing(self) -> bool:
        """Init containers are still to complete, and none failed."""
        return self.init_done < len(self.init_names) and self.waiting is None


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
    pvc_root: Path | None = None  # folders of PersistentVolumeClaims; None: log_dir/pvcs
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
        if self.pvc_root is None:
            self.pvc_root = self.log_dir / "pvcs"
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
            self._remove(pod)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def raise_on_task_error(self) -> None:
        """Raise what stopped the watch loop, if it stopped on an error."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise RuntimeError("kubelet simulator stopped") from error

    def _api_server(self) -> str | None:
        """The API server's URL, as the pods' processes reach it."""
        configuration = getattr(self.api.api_client, "configuration", None)
        return getattr(configuration, "host", None)

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
        pod_spec = template["spec"]
        container = pod_spec["containers"][0]
        inits = list(pod_spec.get("initContainers") or [])
        used = {p.ip for p in self.pods.values()}
        ip = next(i for i in self._ips if i not in used)
        name = f"{meta['name']}-{uuid.uuid4().hex[:5]}"
        # Refuse what cannot run before any object exists (as for a main container).
        serve_command(container, ip, self.port, self.python)
        for init in inits:
            kvfleet_command(init, self.python)
        prestop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}
        grace = float(pod_spec.get("terminationGracePeriodSeconds") or 30)
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
            "spec": {**pod_spec, "nodeName": NODE_NAME},
        }
        created = await asyncio.to_thread(self.api.create, PODS, self.namespace, pod_obj)
        assert self.pvc_root is not None
        pod = SimPod(
            name=name,
            uid=(created.get("metadata") or {}).get("uid", ""),
            deployment=meta["name"],
            ip=ip,
            template=template,
            log_path=self.log_dir / f"{name}.log",
            grace_seconds=grace,
            prestop_seconds=min(float(prestop.get("seconds") or 0), self.prestop_cap_seconds),
            volumes=volume_folders(pod_spec, self.log_dir / "volumes" / name, self.pvc_root),
            init_names=tuple(i["name"] for i in inits),
        )
        for folder in pod.volumes.values():
            folder.mkdir(parents=True, exist_ok=True)
        self.pods[name] = pod
        if inits:
            self._event(pod, "initializing", ", ".join(pod.init_names))
            await self._write_pod_status(pod)
            pod.init_task = asyncio.create_task(self._initialize(pod), name=f"init-{name}")
        else:
            await self._start_main(pod)

    async def _initialize(self, pod: SimPod) -> None:
        """Run the init containers in order, then the main one; stop at the first failure."""
        try:
            for container in pod.template["spec"]["initContainers"]:
                if pod.terminating:
                    return
                code = await self._run_init(pod, container)
                if code is None or pod.terminating:
                    return
                if code != 0:
                    await self._fail_init(pod, container["name"], code)
                    return
                pod.init_done += 1
                self._event(pod, "init-done", container["name"])
                await self._write_pod_status(pod)
            if not pod.terminating:
                await self._start_main(pod)
        except Exception as exc:  # a task nobody awaits: say what stopped it
            log.exception("kubelet-sim: pod %s: init failed", pod.name)
            main = pod.template["spec"]["containers"][0]["name"]
            pod.waiting = Waiting(main, "RunContainerError", f"kubelet simulator: {exc}")
            await self._write_pod_status(pod)

    async def _run_init(self, pod: SimPod, container: Mapping[str, Any]) -> int | None:
        """One init container's exit code; None when it could not be created."""
        name = container["name"]
        mounts = mount_table(container, pod.volumes)
        command = [host_path(a, mounts) for a in kvfleet_command(container, self.python)]
        env = await self._env(pod, container, mounts)
        if env is None:
            return None
        log_path = self.log_dir / f"{pod.name}.{name}.log"
        with log_path.open("wb") as out:
            pod.init_process = await asyncio.create_subprocess_exec(
                *_DIE_WITH_PARENT,
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        self._event(pod, "init-started", f"{name}: {' '.join(command[3:])}")
        await self._write_pod_status(pod)
        return await pod.init_process.wait()

    async def _fail_init(self, pod: SimPod, name: str, code: int) -> None:
        log_path = self.log_dir / f"{pod.name}.{name}.log"
        pod.waiting = Waiting(
            name,
            "CrashLoopBackOff",
            f"back-off restarting failed container {name} in pod {pod.name}",
            exit_code=code,
            log_tail=termination_message(log_path),
        )
        self._event(pod, "init-failed", f"{name} exit code {code}; log {log_path}")
        # The event goes first: whoever sees the status (the operator, a test) then finds it.
        await self._post_event(
            pod, "BackOff", f"Back-off restarting failed container {name} in pod {pod.name}"
        )
        await self._write_pod_status(pod)

    async def _env(
        self, pod: SimPod, container: Mapping[str, Any], mounts: list[tuple[str, Path]]
    ) -> dict[str, str] | None:
        """The container's environment, or None (and the pod waiting) when it cannot be made."""

        async def read_data(kind: str, name: str) -> Mapping[str, Any] | None:
            resource = SECRETS if kind == "Secret" else CONFIGMAPS
            obj = await asyncio.to_thread(self.api.get, resource, self.namespace, name)
            return None if obj is None else (obj.get("data") or {})  # a 404 is None

        try:
            return await container_env(
                container,
                mounts,
                namespace=self.namespace,
                pod_name=pod.name,
                pod_ip=pod.ip,
                node_name=NODE_NAME,
                read_data=read_data,
            )
        except ContainerConfigError as exc:
            name = container["name"]
            pod.waiting = Waiting(name, "CreateContainerConfigError", str(exc))
            self._event(pod, "config-error", f"{name}: {exc}")
            await self._post_event(pod, "Failed", f"Error: {exc}")
            await self._write_pod_status(pod)
            return None

    async def _start_main(self, pod: SimPod) -> None:
        container = pod.template["spec"]["containers"][0]
        mounts = mount_table(container, pod.volumes)
        command = serve_command(container, pod.ip, self.port, self.python, self._api_server())
        command = [host_path(a, mounts) for a in command]
        env = await self._env(pod, container, mounts)
        if env is None:
            return
        with pod.log_path.open("wb") as out:
            pod.process = await asyncio.create_subprocess_exec(
                *_DIE_WITH_PARENT,
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        self._event(pod, "started", " ".join(command[3:]))
        await self._write_pod_status(pod)

    async def _check(self, pod: SimPod) -> None:
        """Readiness probe and crash detection for a running pod."""
        if pod.process is None:  # initializing, or it never started
            return
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
            timeout = min(pod.grace_seconds, self.stop_timeout)
            if pod.init_task is not None and not pod.init_task.done():
                # A running init container gets SIGTERM too; _initialize then starts nothing.
                init = pod.init_process
                if init is not None and init.returncode is None:
                    init.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(pod.init_task), timeout)
            if pod.process is not None:
                if prestop and pod.prestop_seconds:
                    await asyncio.sleep(pod.prestop_seconds)
                pod.in_flight_at_sigterm = await self._in_flight(pod)
                if pod.process.returncode is None:
                    pod.process.send_signal(signal.SIGTERM)
                try:
                    pod.exit_code = await asyncio.wait_for(pod.process.wait(), timeout)
                except TimeoutError:
                    await self._kill(pod)
                self._event(pod, "exited", f"exit code {pod.exit_code}")
            else:
                self._event(pod, "exited", "before its main container started")
            with contextlib.suppress(KubeApiError):
                await asyncio.to_thread(
                    self.api.request,
                    "PATCH",
                    self.api.path(PODS, self.namespace, pod.name),
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                )
        finally:
            if pod.init_task is not None and not pod.init_task.done():
                pod.init_task.cancel()
            await self._kill(pod)  # only does something when cancelled or failed
            self._remove(pod)

    async def _kill(self, pod: SimPod) -> None:
        for process in (pod.init_process, pod.process):
            if process is not None and process.returncode is None:
                process.kill()
                code = await process.wait()
                if process is pod.process:
                    pod.exit_code = code
                self._event(pod, "killed", f"still running after {self.stop_timeout:g}s")

    def _remove(self, pod: SimPod) -> None:
        """Forget the pod; its emptyDir folders go with it (claims' folders stay)."""
        self.pods.pop(pod.name, None)
        shutil.rmtree(self.log_dir / "volumes" / pod.name, ignore_errors=True)

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
        with contextlib.suppress(KubeApiError):  # the pod may be gone already
            await asyncio.to_thread(
                self.api.patch_status, PODS, self.namespace, pod.name, pod_status(pod)
            )

    async def _post_event(self, pod: SimPod, reason: str, message: str) -> None:
        """A Warning Event on the Pod, as the kubelet records failures for kubectl describe."""
        now = _rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{pod.name}.{uuid.uuid4().hex[:16]}",
                "namespace": self.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod.name,
                "namespace": self.namespace,
                "uid": pod.uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": "kubelet", "host": NODE_NAME},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(KubeApiError):
            await asyncio.to_thread(self.api.create, EVENTS, self.namespace, event)

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


def pod_status(pod: SimPod) -> dict[str, Any]:
    """The Pod's status as a kubelet would write it for the simulated pod's state."""
    ready = pod.ready and not pod.terminating
    waiting = pod.waiting
    main_name = pod.template["spec"]["containers"][0]["name"]
    inits: list[dict[str, Any]] = []
    for index, name in enumerate(pod.init_names):
        if waiting is not None and waiting.container == name:
            inits.append(_waiting_status(name, waiting))
        elif index < pod.init_done:
            state = {"terminated": {"exitCode": 0, "reason": "Completed"}}
            inits.append(_container_status(name, state, ready=True))
        elif index == pod.init_done and pod.init_process is not None and pod.initializing:
            inits.append(_container_status(name, {"running": {"startedAt": _rfc3339()}}))
        else:
            inits.append(_container_status(name, {"waiting": {"reason": "PodInitializing"}}))
    if waiting is not None and waiting.container == main_name:
        main = _waiting_status(main_name, waiting)
    elif pod.process is None:
        main = _container_status(main_name, {"waiting": {"reason": "PodInitializing"}})
    elif pod.crashed:
        state = {"terminated": {"exitCode": pod.exit_code, "reason": "Error"}}
        main = _container_status(main_name, state)
    else:
        main = _container_status(main_name, {"running": {"startedAt": _rfc3339()}}, ready=ready)
        main["started"] = True
    initialized = pod.init_done >= len(pod.init_names)
    status: dict[str, Any] = {
        "phase": "Failed" if pod.crashed else "Running" if pod.process else "Pending",
        "podIP": pod.ip,
        "podIPs": [{"ip": pod.ip}],
        "hostIP": "127.0.0.1",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True" if initialized else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ],
        "containerStatuses": [main],
    }
    if inits:
        status["initContainerStatuses"] = inits
    # A kubelet reports the image each container runs (the API server requires both fields).
    spec = pod.template["spec"]
    images = {
        c["name"]: c.get("image", "")
        for c in [*spec.get("initContainers", []), *spec["containers"]]
    }
    for container in [*inits, main]:
        container.update(image=images.get(container["name"], ""), imageID="")
    return status


def _container_status(name: str, state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"name": name, "ready": ready, "started": False, "state": state, "restartCount": 0}


def _waiting_status(name: str, waiting: Waiting) -> dict[str, Any]:
    out = _container_status(
        name, {"waiting": {"reason": waiting.reason, "message": waiting.message}}
    )
    if waiting.exit_code is not None:
        out["lastState"] = {
            "terminated": {
                "exitCode": waiting.exit_code,
                "reason": "Error",
                "message": waiting.log_tail,
            }
        }
    return out


def _rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

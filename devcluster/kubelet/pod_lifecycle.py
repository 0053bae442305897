"""What the kubelet does with a pod once it exists: its containers as processes, readiness,
graceful termination, and the Pod's status and Events.

Init containers (`kvfleet download` for hf:// models) run first, one after the other, each to
completion: meanwhile the Pod is Pending with `initContainerStatuses`. One that exits non-zero
fails the pod as a kubelet would show it (init container waiting in CrashLoopBackOff, its last
exit code and log tail as the termination message, a Warning Event on the Pod) but is not
restarted: a test wants to see the failure, not a loop of them. A Secret or key the env needs
that is missing is a CreateContainerConfigError the same way. Then the main container starts.

Termination follows a real kubelet's: the Pod is deleted (it carries a finalizer, so it stays,
with a deletionTimestamp, while it terminates) and marked not ready so no new request is routed
to it; after the preStop pause the process gets SIGTERM and drains; only when it has exited is
the finalizer removed and the Pod gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kvfleet.devcluster.kubelet.container_process import (
    ContainerConfigError,
    container_env,
    host_path,
    kvfleet_command,
    mount_table,
    serve_command,
    termination_message,
)
from kvfleet.devcluster.kubelet.pod_state import PodEvent, SimPod, Waiting, pod_status, rfc3339_now
from kvfleet.operator.kube_api import PODS, KubeApi, KubeApiError
from kvfleet.operator.metrics_source import MetricsParseError, parse_runtime_metrics

from kvfleet import contract

log = logging.getLogger("kvfleet.kubelet_sim")

# util-linux's setpriv makes the kernel SIGKILL a runtime process whose parent dies without
# cleaning up (a killed test run): no orphaned servers. Without it, stop() is the guarantee.
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
NODE_NAME = "kubelet-sim"
SECRETS = ("", "v1", "secrets")
CONFIGMAPS = ("", "v1", "configmaps")
EVENTS = ("", "v1", "events")


class PodLifecycle:
    """The kubelet half of KubeletSim (a mixin: the dataclass holds the state named below)."""

    __slots__ = ()
    api: KubeApi
    namespace: str
    log_dir: Path
    python: str
    port: int
    stop_timeout: float
    pods: dict[str, SimPod]
    events: list[PodEvent]
    _stopping: set[asyncio.Task[None]]
    _session: aiohttp.ClientSession | None

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
        now = rfc3339_now()
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

    def _event(self, pod: SimPod, what: str, detail: str = "") -> None:
        self.events.append(PodEvent(time.time(), pod.name, pod.ip, what, detail))
        log.info("kubelet-sim: pod %s (%s) %s %s", pod.name, pod.ip, what, detail)

    def _api_server(self) -> str | None:
        """The API server's URL, as the pods' processes reach it."""
        configuration = getattr(self.api.api_client, "configuration", None)
        return getattr(configuration, "host", None)

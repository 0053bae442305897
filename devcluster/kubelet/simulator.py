"""A stand-in for the kubelet and the Deployment controller: real runtime processes as pods.

Used by the end-to-end tests and `kvfleet demo autoscale`, against an API server with no nodes
(the dev cluster's). It polls the Deployments of one namespace and, for each wanted replica,
creates a Pod (template labels, an ownerReference to the Deployment, a finalizer) and starts a
real `kvfleet serve` process from the pod template's container args, bound to its own loopback
address (127.0.0.2, 127.0.0.3, …), like a pod IP (pod_network.py). It writes the Deployment's
status; what happens to each pod afterwards — init containers, readiness once /health answers
200, graceful termination on scale-down — is pod_lifecycle.py. Volumes, paths and env are
translated to the host as container_process.py says.

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
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kvfleet.devcluster.kubelet.container_process import (
    kvfleet_command,
    serve_command,
    volume_folders,
)
from kvfleet.devcluster.kubelet.pod_lifecycle import NODE_NAME, PodLifecycle
from kvfleet.devcluster.kubelet.pod_network import choose_port, pod_ips
from kvfleet.devcluster.kubelet.pod_state import PodEvent, SimPod
from kvfleet.operator.kube_api import DEPLOYMENTS, PODS, KubeApi, KubeApiError

log = logging.getLogger("kvfleet.kubelet_sim")

FINALIZER = "kvfleet.dev/kubelet-sim"


@dataclass(slots=True)
class KubeletSim(PodLifecycle):
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

    # --- the Deployment's status -------------------------------------------------------
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

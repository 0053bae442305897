"""A simulated pod's state (its init containers, its processes, ready, terminating, why it
waits), what happened to it (`PodEvent`), and the Pod status a kubelet would write for it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
            inits.append(_container_status(name, {"running": {"startedAt": rfc3339_now()}}))
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
        main = _container_status(main_name, {"running": {"startedAt": rfc3339_now()}}, ready=ready)
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


def rfc3339_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

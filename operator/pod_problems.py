"""Why an InferenceService's pods cannot run, read (purely) from the Pod status the scheduler
and the kubelet write: one Degraded reason per cause, because each is fixed differently
(docs/troubleshooting.md lists them with what to do)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.render import CONTAINER_NAME, DOWNLOAD_CONTAINER_NAME
from kvfleet.operator.render_router import ROUTER_CONTAINER_NAME

UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL_FAILED = "ImagePullFailed"
CRASH_LOOP = "CrashLoop"
OOM_KILLED = "OOMKilled"
MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"
# Every reason a pod's problem can give the Degraded condition: the four above, the download's,
# and the kubelet's own for a container it cannot even create (a missing Secret or ConfigMap).
CONFIG_REASONS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
)
POD_REASONS = frozenset(
    {UNSCHEDULABLE, IMAGE_PULL_FAILED, CRASH_LOOP, OOM_KILLED, MODEL_DOWNLOAD_FAILED}
    | CONFIG_REASONS
)
_IMAGE_PULL_WAITING = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
# The spec field that sets each container's memory limit, for the OOMKilled message.
_MEMORY_FIELD = {
    CONTAINER_NAME: "spec.resources.memory",
    DOWNLOAD_CONTAINER_NAME: "spec.resources.memory",
    ROUTER_CONTAINER_NAME: "spec.router.memory",
}
# A log line that reports a failure: `ERROR kvfleet.serve: ...`, `kvfleet download: error: ...`,
# `torch.OutOfMemoryError: ...`; `error\b` so that a path like error_handler.py is no match.
_ERROR_LINE = re.compile(r"(?i)(error|exception|fatal|critical)\b")
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T][0-9:.,]+Z?\s+")
MESSAGE_CHARS = 2048  # a condition message a human still reads whole


@dataclass(slots=True, frozen=True)
class PodProblem:
    """Why one pod cannot serve: a reason from POD_REASONS and a message naming the pod."""

    reason: str
    message: str


def log_tail(log: str, lines: int = 3) -> str:
    """The last lines of a termination message, joined: where a short program (the download)
    says what failed."""
    kept = [line.strip() for line in log.strip().splitlines() if line.strip()]
    return " / ".join(kept[-lines:])


def first_error(log: str) -> str:
    """The first line of a termination message (the log's last lines) that reports an error,
    timestamp dropped: the cause, before the tracebacks and shutdown lines that follow it. The
    last lines when none does."""
    for raw in log.splitlines():
        line = raw.strip()
        if line.startswith(("Traceback", 'File "')) or not _ERROR_LINE.search(line):
            continue
        return _TIMESTAMP.sub("", line)
    return log_tail(log)


def _container_spec(pod: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if container.get("name") == name:
            return container
    return {}


def _requests(pod: Mapping[str, Any]) -> str:
    """What the pod's main container asks the scheduler for, e.g. `cpu 4, memory 16Gi,
    nvidia.com/gpu 1`."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    requests = (containers[0].get("resources") or {}).get("requests") or {}
    return ", ".join(f"{k} {v}" for k, v in requests.items())


def _unschedulable(pod: Mapping[str, Any], pod_name: str) -> PodProblem | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == UNSCHEDULABLE
        ):
            message = f"pod {pod_name} cannot be scheduled: {cond.get('message') or 'no node fits'}"
            if requests := _requests(pod):
                message += f" (each pod requests {requests})"
            return PodProblem(UNSCHEDULABLE, message)
    return None


def _restarts(cs: Mapping[str, Any]) -> str:
    count = int(cs.get("restartCount") or 0)
    return f"restarted {count} time{'' if count == 1 else 's'}"


def _crashed(
    pod: Mapping[str, Any], where: str, cs: Mapping[str, Any], waiting: Mapping[str, Any]
) -> PodProblem:
    """A container in CrashLoopBackOff, told by how its last run ended."""
    name = cs.get("name", "?")
    last = (cs.get("lastState") or {}).get("terminated") or {}
    code = f"exit code {last['exitCode']}" if "exitCode" in last else "no exit code yet"
    if last.get("reason") == OOM_KILLED:
        limit = ((_container_spec(pod, name).get("resources") or {}).get("limits") or {}).get(
            "memory"
        )
        field = _MEMORY_FIELD.get(name, "its memory limit")
        bound = f"its memory limit of {limit}" if limit else "its memory limit"
        return PodProblem(
            OOM_KILLED,
            f"{where} was killed for using more than {bound} ({_restarts(cs)}); "
            f"raise {field} or serve a smaller model or context",
        )
    log = last.get("message", "")
    if name == DOWNLOAD_CONTAINER_NAME:
        # The download's last lines say which file or repository failed and how (401, 404).
        detail = log_tail(log) or waiting.get("message") or _restarts(cs)
        return PodProblem(MODEL_DOWNLOAD_FAILED, f"{where}: {code}: {detail}")
    detail = first_error(log) if log.strip() else waiting.get("message", "no log")
    return PodProblem(CRASH_LOOP, f"{where} keeps exiting ({_restarts(cs)}), {code}: {detail}")


def _container_problem(pod: Mapping[str, Any], pod_name: str) -> PodProblem | None:
    status = pod.get("status") or {}
    for key, kind in (
        ("initContainerStatuses", "init container"),
        ("containerStatuses", "container"),
    ):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason", "")
            where = f"pod {pod_name} {kind} {cs.get('name', '?')}"
            if reason in _IMAGE_PULL_WAITING:
                image = cs.get("image") or _container_spec(pod, cs.get("name", "")).get("image")
                detail = waiting.get("message") or reason
                return PodProblem(
                    IMAGE_PULL_FAILED, f"{where}: cannot pull image {image}: {reason}: {detail}"
                )
            if reason == "CrashLoopBackOff":
                return _crashed(pod, where, cs, waiting)
            if reason in CONFIG_REASONS:
                return PodProblem(reason, f"{where}: {reason}: {waiting.get('message', '')}")
    return None


def pod_problem(pod: Mapping[str, Any]) -> PodProblem | None:
    """Why this pod cannot serve, or None while it runs or is on its way (pulling, starting,
    downloading, or gone: a pod that is being deleted or has ended is not waited for)."""
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
        return None
    name = meta.get("name", "?")
    return _unschedulable(pod, name) or _container_problem(pod, name)


def pods_problem(pods: Iterable[Mapping[str, Any]]) -> PodProblem | None:
    """The first pod's problem, with how many other pods have one too."""
    problems = [p for p in map(pod_problem, pods) if p is not None]
    if not problems:
        return None
    first = problems[0]
    message = first.message
    if len(problems) > 1:
        others = len(problems) - 1
        message += f"; {others} more pod{'' if others == 1 else 's'} cannot run either"
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    return PodProblem(first.reason, message)

"""A pod template's container as a process on this host, for the kubelet simulator.

The simulator runs only kvfleet containers: `command: [kvfleet]` becomes this interpreter's
`-m kvfleet.runtime.cli` (the same installation, no PATH lookup). What a node would provide is
translated to the host:

- volumes: an `emptyDir` (not in memory) is a folder per pod, a `persistentVolumeClaim` a
  folder per claim shared by every pod (`<pvc_root>/<claimName>`); other volumes, and mounts
  at /tmp and /dev/shm, stay the host's own (test models live under the host's /tmp).
- paths: an env value or argument at or below a translated mount's path is rewritten to the
  host folder (HF_HOME=/var/cache/kvfleet/huggingface → <pod folder>/cache/huggingface).
- environment: the simulator's own environment (the "image's" variables), then the
  container's `env` in order: literal values; `secretKeyRef` and `configMapKeyRef` read from
  the API server (missing and not optional: ContainerConfigError, as the kubelet's
  CreateContainerConfigError); `fieldRef` for the pod's name, namespace, IP and node; other
  sources (resourceFieldRef) are skipped. `$(VAR)` references are not expanded.
"""

from __future__ import annotations

import base64
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("kvfleet.kubelet_sim")

# Mounts left to the host: the process shares the host's /tmp and /dev/shm.
HOST_MOUNTS = frozenset({"/tmp", "/dev/shm"})
# The kubelet keeps this much of a failed container's log as its termination message
# (terminationMessagePolicy: FallbackToLogsOnError).
TERMINATION_MESSAGE_BYTES = 2048
TERMINATION_MESSAGE_LINES = 80

# (kind, name) -> the `data` of that Secret or ConfigMap in the pod's namespace, None if absent
ObjectData = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


class ContainerConfigError(Exception):
    """The container cannot be created (a Secret or key it needs is missing): it never starts."""


def kvfleet_command(container: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """The process for a kvfleet container; ValueError for any other command."""
    command = list(container.get("command") or [])
    if command != ["kvfleet"]:
        raise ValueError(
            f"container {container.get('name')!r} runs {command!r}; the kubelet simulator runs "
            "only `command: [kvfleet]` containers"
        )
    return [python, "-m", "kvfleet.runtime.cli", *(container.get("args") or [])]


def volume_folders(
    pod_spec: Mapping[str, Any], pod_folder: Path, pvc_root: Path
) -> dict[str, Path]:
    """Host folders for the pod's volumes the simulator provides, by volume name."""
    folders: dict[str, Path] = {}
    for volume in pod_spec.get("volumes") or []:
        empty_dir = volume.get("emptyDir")
        claim = volume.get("persistentVolumeClaim")
        if empty_dir is not None and (empty_dir or {}).get("medium") != "Memory":
            folders[volume["name"]] = pod_folder / volume["name"]
        elif claim is not None:
            folders[volume["name"]] = pvc_root / claim["claimName"]
    return folders


def mount_table(
    container: Mapping[str, Any], folders: Mapping[str, Path]
) -> list[tuple[str, Path]]:
    """(mount path, host folder) for the container's translated mounts, deepest first."""
    table = [
        (m["mountPath"].rstrip("/"), folders[m["name"]] / m.get("subPath", ""))
        for m in container.get("volumeMounts") or []
        if m["name"] in folders and m["mountPath"].rstrip("/") not in HOST_MOUNTS
    ]
    return sorted(table, key=lambda row: len(row[0]), reverse=True)


def host_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """`value` with a leading container mount path replaced by its host folder."""
    for mount, folder in mounts:
        if value == mount or value.startswith(mount + "/"):
            return str(folder) + value[len(mount) :]
    return value


async def container_env(
    container: Mapping[str, Any],
    mounts: list[tuple[str, Path]],
    *,
    namespace: str,
    pod_name: str,
    pod_ip: str,
    node_name: str,
    read_data: ObjectData,
) -> dict[str, str]:
    """The process environment for `container` (see the module docstring for the rules)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fields = {
        "metadata.name": pod_name,
        "metadata.namespace": namespace,
        "status.podIP": pod_ip,
        "status.hostIP": "127.0.0.1",
        "spec.nodeName": node_name,
    }
    for item in container.get("env") or []:
        name = item["name"]
        source = item.get("valueFrom")
        if source is None:
            env[name] = host_path(str(item.get("value", "")), mounts)
            continue
        value: str | None = None
        for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
            if key in source:
                value = await _key_ref(kind, source[key], namespace, read_data)
                break
        else:
            path = (source.get("fieldRef") or {}).get("fieldPath", "")
            if path in fields:
                value = fields[path]
            else:
                log.warning("kubelet-sim: env %s: unsupported source %s, skipped", name, source)
        if value is not None:
            env[name] = value
    return env


async def _key_ref(
    kind: str, ref: Mapping[str, Any], namespace: str, read_data: ObjectData
) -> str | None:
    """A key of a Secret or ConfigMap; None when absent and optional (the variable is unset)."""
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))
    data = await read_data(kind, name)
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{name}" not found')
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    value = str(data[key])
    return base64.b64decode(value).decode() if kind == "Secret" else value


def termination_message(log_path: Path) -> str:
    """The end of a failed container's log, as FallbackToLogsOnError keeps it."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TERMINATION_MESSAGE_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(tail.splitlines()[-TERMINATION_MESSAGE_LINES:])


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

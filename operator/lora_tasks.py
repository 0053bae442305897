"""The LoRA adapters' loop: one asyncio task per InferenceService that lists spec.loras, which
loads them into its ready pods and unloads the ones removed (lora_sync.py does one pass).

A pass runs when the loop starts, when the spec changes (a new generation), when one of the
object's pods changes (a pod turned ready after a scale-up or a restart gets its adapters at
once), and every LORA_RESYNC_SECONDS in between: a runtime that lost its adapters without its
pod changing (a container restart is a pod change; a failed load tried again is not) is put
right by then. The loops are started and stopped from watch events as the autoscaler's are
(object_loops.py), with no finalizer, and live in kopf's event loop, so only the leader runs
them.

After a pass that changed status.loras the reconciler is queued (handlers.py passes its
refresh queue's `add`): it alone writes the Degraded condition, from status.loras.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import kopf
from kvfleet.operator.autoscale_loop import RUNTIME_PORT_SETTING
from kvfleet.operator.kube_api import ISVCS, KubeApiError
from kvfleet.operator.lora_sync import LoraState, sync_once
from kvfleet.operator.object_loops import ObjectLoops, WatchedObject, gone
from kvfleet.operator.render import MANAGED_BY

from kvfleet import contract

if TYPE_CHECKING:
    from kvfleet.operator.handlers import OperatorConfig

log = logging.getLogger("kvfleet.lora")

LORA_RESYNC_SECONDS = 30.0
RESYNC_SETTING = "lora_resync_seconds"  # OperatorConfig.extra, for tests: seconds between passes


def lists_loras(body: Mapping[str, Any]) -> bool:
    """Whether this InferenceService should have a loop: spec.loras lists an adapter."""
    loras = (body.get("spec") or {}).get("loras")
    return isinstance(loras, list) and bool(loras)


async def sync_until_stopped(
    config: OperatorConfig, refresh: Callable[[str, str], None], watched: WatchedObject
) -> None:
    """Passes until `watched.stop` is set or the InferenceService is gone. Raises what a pass
    raised that is not worth a retry (ObjectLoops starts the loop again)."""
    api = config.client()
    port = int(config.extra.get(RUNTIME_PORT_SETTING, contract.RUNTIME_PORT))
    interval = float(config.extra.get(RESYNC_SETTING, LORA_RESYNC_SECONDS))
    state = LoraState()
    async with aiohttp.ClientSession() as session:
        while not watched.stop.is_set():
            watched.wake.clear()  # news from now on means one more pass
            isvc = watched.body
            if await asyncio.to_thread(gone, api, isvc):
                return
            meta = isvc["metadata"]
            try:
                if await sync_once(api, isvc, state, session, port):
                    refresh(meta["namespace"], meta["name"])
            except KubeApiError as exc:
                if not exc.retryable:
                    raise
                log.warning("%s: Kubernetes API: %s; retrying", watched.namespaced_name, exc)
            await _until_news(watched, interval)


async def _until_news(watched: WatchedObject, seconds: float) -> None:
    """Sleep for `seconds`, or until the loop is woken or stopped."""
    waits = [asyncio.create_task(e.wait()) for e in (watched.wake, watched.stop)]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        for task in waits:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def register_lora_sync(
    registry: kopf.OperatorRegistry, config: OperatorConfig, refresh: Callable[[str, str], None]
) -> ObjectLoops:
    """Add the adapters' handlers to the operator's registry (handlers.build_registry calls
    this); `refresh(namespace, name)` queues a reconcile. The loops belong to this registry."""
    loops = ObjectLoops(
        functools.partial(sync_until_stopped, config, refresh),
        lists_loras,
        label="LoRA adapters",
        log=log,
    )

    # Async, so that kopf runs these in its event loop (the loops'), not in a worker thread.
    @kopf.on.event(*ISVCS, registry=registry)
    async def lora_loops(type: str | None, body: kopf.Body, **_: Any) -> None:
        loops.observe(type, body)

    @kopf.on.event(
        "", "v1", "pods", labels={"app.kubernetes.io/managed-by": MANAGED_BY}, registry=registry
    )
    async def lora_pod_changed(body: kopf.Body, **_: Any) -> None:
        # Pods are owned by ReplicaSets; the instance label names the InferenceService.
        name = (body.metadata.get("labels") or {}).get("app.kubernetes.io/instance")
        if name:
            loops.wake_up(body.metadata["namespace"], name)

    @kopf.on.cleanup(registry=registry)
    async def stop_lora_loops(**_: Any) -> None:
        await loops.stop_all()

    return loops

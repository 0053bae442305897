"""The autoscaler's loop for one InferenceService: poll, then sleep until the next poll is due.

autoscale_tasks.py runs one loop per InferenceService whose `spec.autoscaling.enabled` is true,
puts each watch event's copy of the object into its `WatchedObject` and sets `stop` when the
loop should end. So every poll sees the live spec, and `pollIntervalSeconds` is per object and
may change: after each poll the loop rereads it and sleeps until the next poll is due (a
`@kopf.timer` could not do that: its interval is fixed at registration).

A failing poll does not end the loop: a Kubernetes API error worth retrying is logged and the
next poll tries again; anything else ends this run of the loop, and autoscale_tasks.py logs it
and starts the loop again after a pause. The loop ends itself when its InferenceService is
gone, found by a read before each poll should the DELETED event have been missed.

Settings in `OperatorConfig.extra` (for tests and the demo; a cluster needs neither):
- `RUNTIME_PORT_SETTING`: the port scraped on each pod IP (default contract.RUNTIME_PORT), and
  the one the LoRA adapters' loop (lora_tasks.py) loads adapters through;
- `OBSERVERS_SETTING`: callables given a `PollReport` after each poll (the demo's live view).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from kvfleet.operator import metrics
from kvfleet.operator.autoscale_poll import AutoscalerState, poll_once
from kvfleet.operator.autoscale_report import AUTOSCALER_READY, PollReport
from kvfleet.operator.kube_api import KubeApi, KubeApiError
from kvfleet.operator.object_loops import WatchedObject, gone, pause
from kvfleet.operator.spec import SpecError, parse_autoscaling

from kvfleet import contract

if TYPE_CHECKING:
    from kvfleet.operator.handlers import OperatorConfig

log = logging.getLogger("kvfleet.autoscaler")

RUNTIME_PORT_SETTING = "runtime_port"
OBSERVERS_SETTING = "autoscaler_observers"

# The names the demo (cmd_demo.py) and the end-to-end tests take from here: the settings, and
# what an observer is given.
__all__ = [
    "AUTOSCALER_READY",
    "OBSERVERS_SETTING",
    "RUNTIME_PORT_SETTING",
    "PollReport",
    "WatchedObject",
    "pause",
    "poll_until_stopped",
]


async def poll_until_stopped(config: OperatorConfig, watched: WatchedObject) -> None:
    """Poll every pollIntervalSeconds until `watched.stop` is set or the InferenceService is
    gone. Raises what a poll raised that is not worth a retry (autoscale_tasks.py restarts it)."""
    api: KubeApi = config.client()
    port = int(config.extra.get(RUNTIME_PORT_SETTING, contract.RUNTIME_PORT))
    observers: Sequence[Callable[[PollReport], None]] = config.extra.get(OBSERVERS_SETTING, ())
    state = AutoscalerState()
    async with aiohttp.ClientSession() as session:
        while not watched.stop.is_set():
            started = time.monotonic()
            isvc = watched.body
            if await asyncio.to_thread(gone, api, isvc):
                metrics.forget(isvc["metadata"]["namespace"], isvc["metadata"]["name"])
                return
            try:
                report = await poll_once(api, isvc, state, session, port)
            except KubeApiError as exc:
                if not exc.retryable:
                    raise
                log.warning(
                    "%s: Kubernetes API: %s; retrying next poll", watched.namespaced_name, exc
                )
                report = None
            if report is not None:
                for observe in observers:
                    try:
                        observe(report)
                    except Exception:  # a watcher's bug must not stop the scaling
                        log.exception("autoscaler observer %r failed", observe)
            interval = _poll_interval(watched.body.get("spec") or {})
            await pause(watched.stop, max(0.0, interval - (time.monotonic() - started)))


def _poll_interval(spec: Mapping[str, Any]) -> float:
    try:
        return parse_autoscaling(spec.get("autoscaling")).check().poll_interval_seconds
    except SpecError:
        # The poll reported the spec as unusable; look again at the CRD's default interval.
        return parse_autoscaling(None).poll_interval_seconds

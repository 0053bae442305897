"""The autoscaler's tasks: one asyncio task per autoscaled InferenceService, started and stopped
from the object's watch events through kopf's public API, and no finalizer.

Why not a `@kopf.daemon`: kopf gives every daemon's object a finalizer (so that it can stop the
daemon before the object goes) and offers no option against it; its maintainer declined one
(nolar/kopf#896), naming the older pattern instead: start a task from a handler, stop it on
deletion. A finalizer would leave every autoscaled InferenceService stuck in Terminating once
the operator is uninstalled (tests/operator/test_finalizers.py).

So a `@kopf.on.event` handler sees every watch event of every InferenceService, the initial
listing included (a restarted operator resumes its loops), and brings `AutoscalerTasks` (the
generic part is object_loops.py, which the LoRA adapters' loops share) in line with the latest
one: a loop (autoscale_loop.py) runs per uid while `spec.autoscaling.enabled` is true and the
object is not being deleted; a DELETED event, a deletionTimestamp or autoscaling turned off
stop it, and `@kopf.on.cleanup` stops them all when the operator exits. A stopped
loop finishes its current poll, or is cancelled after STOP_TIMEOUT_SECONDS; a loop that raised
is logged and started again after RESTART_BACKOFF_SECONDS, with a fresh state.

Only the leader acts: of several operator replicas only the Lease holder runs kopf at all
(cmd_operator.py, leader_election.py), so only it gets these events; the tasks live in kopf's
event loop and end with it (a replica that loses the Lease exits at once).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import kopf
from kvfleet.operator.autoscale_loop import WatchedObject, poll_until_stopped
from kvfleet.operator.kube_api import ISVCS
from kvfleet.operator.object_loops import (
    RESTART_BACKOFF_SECONDS,
    STOP_TIMEOUT_SECONDS,
    ObjectLoops,
)

if TYPE_CHECKING:
    from kvfleet.operator.handlers import OperatorConfig

log = logging.getLogger("kvfleet.autoscaler")


def autoscaling_enabled(body: Mapping[str, Any]) -> bool:
    """Whether this InferenceService should have a loop: `spec.autoscaling.enabled` is true and
    the object is not being deleted."""
    auto = (body.get("spec") or {}).get("autoscaling")
    deleting = (body.get("metadata") or {}).get("deletionTimestamp")
    return isinstance(auto, Mapping) and auto.get("enabled") is True and not deleting


class AutoscalerTasks(ObjectLoops):
    """The autoscaler loops of one operator run, by InferenceService uid (object_loops.py)."""

    def __init__(
        self,
        run_loop: Callable[[WatchedObject], Awaitable[None]],
        *,
        restart_backoff: float = RESTART_BACKOFF_SECONDS,
        stop_timeout: float = STOP_TIMEOUT_SECONDS,
    ) -> None:
        super().__init__(
            run_loop,
            autoscaling_enabled,
            label="autoscaler",
            log=log,
            restart_backoff=restart_backoff,
            stop_timeout=stop_timeout,
        )


def register_autoscaler(registry: kopf.OperatorRegistry, config: OperatorConfig) -> AutoscalerTasks:
    """Add the autoscaler's handlers to the operator's registry (handlers.build_registry calls
    this); the returned tasks belong to this registry alone. See autoscale_loop.py for the
    settings in `config.extra`."""
    tasks = AutoscalerTasks(functools.partial(poll_until_stopped, config))

    # Async, so that kopf runs it in its event loop (the tasks' loop), not in a worker thread.
    @kopf.on.event(*ISVCS, registry=registry)
    async def autoscaler_tasks(type: str | None, body: kopf.Body, **_: Any) -> None:
        tasks.observe(type, body)

    @kopf.on.cleanup(registry=registry)
    async def stop_autoscalers(**_: Any) -> None:
        await tasks.stop_all()

    return tasks

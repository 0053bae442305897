"""The reconciler and the autoscaler write conditions into one status list; neither may erase
the other's, whatever order their reads and writes interleave in. And of two reconciles of one
InferenceService, the status written last is the one computed from the newer reads."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from kube_harness import DEPLOYMENT, ISVC, deployment_available, isvc_with
from kvfleet.operator import conditions as c
from kvfleet.operator.autoscale_poll import write_status as write_autoscaler_status
from kvfleet.operator.autoscale_report import AUTOSCALER_READY
from kvfleet.operator.handlers import OperatorConfig, refresh_from_child, write_status
from kvfleet.operator.kube_api import ISVCS, KubeApi

NS = "default"


def types(obj) -> dict[str, str]:
    return {x["type"]: x["reason"] for x in obj["status"]["conditions"]}


async def test_a_reconcile_from_a_stale_read_keeps_the_autoscalers_condition(kube):
    kube.emulator.create_object(ISVC, isvc_with("chat"))
    api = KubeApi.from_environment()
    config = OperatorConfig(api=api)
    stale = await asyncio.to_thread(api.get, ISVCS, NS, "chat")  # the reconciler reads...

    # ...the autoscaler writes its condition in between...
    ready = c.Condition(AUTOSCALER_READY, c.FALSE, "InvalidSpec", "spec.autoscaling: bad")
    await asyncio.to_thread(write_autoscaler_status, api, NS, "chat", None, ready)

    # ...and the reconciler writes what it computed from its older read.
    computed = {
        "conditions": c.merge_conditions(
            (stale.get("status") or {}).get("conditions"),
            [c.Condition(c.READY, c.FALSE, "NoReplicasReady", "0 of 1 replicas ready")],
            observed_generation=1,
        )
    }
    await asyncio.to_thread(write_status, config, stale, computed)

    now = await asyncio.to_thread(api.get, ISVCS, NS, "chat")
    assert types(now) == {c.READY: "NoReplicasReady", AUTOSCALER_READY: "InvalidSpec"}

    # And the other way round: the autoscaler's write keeps the reconciler's conditions.
    ready = c.Condition(AUTOSCALER_READY, c.TRUE, "MetricsRead", "")
    await asyncio.to_thread(write_autoscaler_status, api, NS, "chat", None, ready)
    now = await asyncio.to_thread(api.get, ISVCS, NS, "chat")
    assert types(now) == {c.READY: "NoReplicasReady", AUTOSCALER_READY: "MetricsRead"}


@dataclass(slots=True)
class PausedBeforeStatusWrite(KubeApi):
    """A client whose first status write waits, its reads done, until `resume` is set."""

    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)

    def patch_preconditioned(self, *args: Any, **kwargs: Any) -> Any:
        if not self.paused.is_set():
            self.paused.set()
            self.resume.wait(timeout=10)
        return KubeApi.patch_preconditioned(self, *args, **kwargs)


async def test_a_reconcile_from_older_reads_never_writes_its_status_last(kube):
    # Every child's event starts a reconcile of the InferenceService: one that read the
    # Deployment before it became available must not write its status after one that read it
    # since; no further event would come to correct it.
    k8s = kube.emulator
    k8s.create_object(ISVC, isvc_with("chat"))
    slow = PausedBeforeStatusWrite(KubeApi.from_environment().api_client)
    config = OperatorConfig(api=slow)
    older = asyncio.create_task(asyncio.to_thread(refresh_from_child, config, NS, "chat"))
    # It made the Deployment, read it with no replica ready, and is about to say so.
    assert await asyncio.to_thread(slow.paused.wait, 10)

    k8s.mutate(DEPLOYMENT, NS, "chat", deployment_available())
    newer = asyncio.create_task(asyncio.to_thread(refresh_from_child, config, NS, "chat"))
    # Unserialised, the newer one writes now; serialised, it waits for the older one (then the
    # wait below ends unfinished and only makes this test slower).
    await asyncio.wait([newer], timeout=2)
    slow.resume.set()
    await asyncio.gather(older, newer)

    ready = c.find_condition(k8s.get(ISVC, NS, "chat")["status"]["conditions"], c.READY)
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")

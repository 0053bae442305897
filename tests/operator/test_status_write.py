"""The reconciler and the autoscaler write conditions into one status list; neither may erase
the other's, whatever order their reads and writes interleave in."""

from __future__ import annotations

import asyncio

from kube_harness import ISVC, isvc_with
from kvfleet.operator import conditions as c
from kvfleet.operator.autoscale_loop import AUTOSCALER_READY
from kvfleet.operator.autoscale_loop import write_status as write_autoscaler_status
from kvfleet.operator.handlers import OperatorConfig, write_status
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

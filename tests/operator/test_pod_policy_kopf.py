"""kopf running the operator against the emulator (which validates Deployments and budgets as
the API server of the chart's minimum Kubernetes does) while a user turns the pod-policy
knobs: the children follow each change, fields the operator no longer renders included."""

from __future__ import annotations

from kube_harness import DEPLOYMENT, ISVC, eventually, isvc_with
from kvfleet.operator.conditions import find_condition

NS = "default"
PDB = "policy/v1/poddisruptionbudgets"


def strategy(k8s, name: str):
    return ((k8s.get(DEPLOYMENT, NS, name) or {}).get("spec") or {}).get("strategy")


async def test_switching_to_recreate_and_back_rewrites_the_strategy(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", rollout={"maxSurge": 0, "maxUnavailable": 1}))
    await eventually(
        lambda: (
            strategy(k8s, "chat")
            == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        )
    )
    # The API server refuses Recreate beside a rollingUpdate: the operator's apply must drop
    # the bounds it set before.
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(rollout={"type": "Recreate"}))
    await eventually(lambda: strategy(k8s, "chat") == {"type": "Recreate"})
    degraded = find_condition(k8s.get(ISVC, NS, "chat")["status"]["conditions"], "Degraded")
    assert degraded["status"] == "False", degraded
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].pop("rollout"))
    await eventually(
        lambda: (
            strategy(k8s, "chat")
            == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        )
    )


async def test_a_budget_set_by_hand_replaces_and_then_removes_the_automatic_one(operator):
    k8s = operator.emulator
    k8s.create_object(ISVC, isvc_with("chat", replicas=1, disruptionBudget={"minAvailable": 1}))
    pdb = await eventually(lambda: k8s.get(PDB, NS, "chat"))
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    k8s.mutate(ISVC, NS, "chat", lambda o: o["spec"].update(disruptionBudget={"enabled": False}))
    await eventually(lambda: k8s.get(PDB, NS, "chat") is None)

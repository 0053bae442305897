"""The operator's leader killed in the middle of a scale-up (spec.replicas 1 -> 3): the
standby takes the Lease and the service converges, its Deployment at 3 replicas and its status
Ready on the new generation, within 15 s of the kill."""

from __future__ import annotations

import signal
import time

import pytest
from kube_harness import DEPLOYMENT, ISVC, deployment_available, eventually
from kvfleet.operator.conditions import find_condition
from operator_processes import Cluster
from test_operator_ha import fast_pair

CONVERGED_WITHIN = 15.0
NS = "default"


def deployment_patches(cluster: Cluster, replica) -> int:
    return cluster.writes_by(replica).count(f"PATCH /apis/apps/v1/namespaces/{NS}/deployments/one")


def converged(cluster: Cluster, generation: int) -> bool:
    k8s = cluster.kube.emulator
    dep = k8s.get(DEPLOYMENT, NS, "one")
    if dep["spec"]["replicas"] != 3:
        return False
    if (dep.get("status") or {}).get("availableReplicas") != 3:
        k8s.mutate(DEPLOYMENT, NS, "one", deployment_available(3))  # the kubelets' part
        return False
    status = k8s.get(ISVC, NS, "one").get("status") or {}
    ready = find_condition(status.get("conditions") or [], "Ready") or {}
    return (
        status.get("observedGeneration") == generation
        and ready.get("status") == "True"
        and status.get("replicas") == 3
    )


@pytest.mark.parametrize("when", ["before it acts", "after its Deployment write"])
async def test_a_leader_killed_mid_scale_up_leaves_it_converged_under_the_next(cluster, when):
    leader, standby, _ = await fast_pair(cluster)
    k8s = cluster.kube.emulator
    k8s.mutate(DEPLOYMENT, NS, "one", deployment_available(1))
    writes = deployment_patches(cluster, leader)
    scaled = k8s.mutate(ISVC, NS, "one", lambda o: o["spec"].update(replicas=3))
    generation = scaled["metadata"]["generation"]
    if when == "after its Deployment write":
        await eventually(lambda: deployment_patches(cluster, leader) > writes, timeout=10)
    leader.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    await eventually(lambda: converged(cluster, generation), timeout=CONVERGED_WITHIN + 5)
    took = time.monotonic() - killed
    print(f"killed {when}: converged {took:.2f}s after the kill")
    assert took <= CONVERGED_WITHIN
    assert standby.process.returncode is None
    # The new leader did the rest (the status, and the scale when the old one had not).
    assert cluster.writes_by(standby)

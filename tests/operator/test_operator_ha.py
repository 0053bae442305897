"""Several `kvfleet operator` processes against one API server, as the chart runs them with
replicas > 1: exactly one acts, the others only watch their Lease; when the active one is
killed, stopped or loses its Lease, another takes over within the stated bound.

Each process has its own bearer token, so the emulator's request log says who did what.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

from kube_harness import DEPLOYMENT, ISVC, LEASE, Kube, eventually, isvc_with
from kvfleet.operator.leader_election import LeaseTiming, micro_time
from operator_processes import RELEASE_NS, Cluster, Replica, chart_operator, lease_name

# Short enough for a test, the same shape as the defaults (15 / 10 / 2).
FAST = LeaseTiming(lease_duration=3, renew_deadline=2.0, retry_period=0.5).check()
FAST_FLAGS = [
    f"--lease-duration={FAST.lease_duration}",
    f"--renew-deadline={FAST.renew_deadline}",
    f"--retry-period={FAST.retry_period}",
]
# What a fresh process needs before its first Lease request (imports, kopf start-up), on a
# loaded 2-core machine.
STARTUP_SLACK = 6.0


def deployment(kube: Kube, name: str) -> Callable[[], object]:
    return lambda: kube.emulator.get(DEPLOYMENT, "default", name)


async def test_chart_with_two_replicas_has_exactly_one_acting(cluster):
    """The chart's own args and env for replicas=2, run as two processes: one reconciles and
    autoscales, the other touches nothing but its Lease. (With kopf peering, both paused.)"""
    args, env, _ = chart_operator({"replicas": 2})
    first = await cluster.start("kvfleet-a", args, env)
    second = await cluster.start("kvfleet-b", args, env)
    autoscaled = {"enabled": True, "pollIntervalSeconds": 1}
    cluster.kube.emulator.create_object(ISVC, isvc_with("chat", autoscaling=autoscaled))

    await eventually(deployment(cluster.kube, "chat"), timeout=20)
    await asyncio.sleep(3)  # a few autoscaler polls and reconciles, and as many chances to err
    acting = [r for r in (first, second) if cluster.writes_by(r)]
    assert len(acting) == 1, {r.pod: cluster.writes_by(r) for r in (first, second)}
    (leader,) = acting
    (standby,) = [r for r in (first, second) if r is not leader]
    assert cluster.holder(lease_name(args)).startswith(f"{leader.pod}_")
    # The standby runs no kopf at all: it touches nothing but its Lease (a POST to the
    # collection when both raced to create it and the other won).
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NS}/leases"
    touched = {r.url.path for r in cluster.requests_by(standby)}
    assert touched and touched <= {leases, f"{leases}/{lease_name(args)}"}, touched
    # Only the leader's autoscaler polls: it lists the InferenceService's pods.
    polls = [r for r in cluster.requests_by(leader) if r.url.path.endswith("/pods")]
    assert len(polls) >= 2
    assert standby.process.returncode is None  # waiting, not crashed


async def fast_pair(cluster: Cluster) -> tuple[Replica, Replica, str]:
    """Two replicas with short Lease timings; the first started is the leader."""
    args, env, _ = chart_operator({"replicas": 2})
    args = args + FAST_FLAGS
    lease = lease_name(args)
    leader = await cluster.start("kvfleet-a", args, env)
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-a_"), timeout=15)
    standby = await cluster.start("kvfleet-b", args, env)
    # The standby is up once it has read the Lease.
    await eventually(lambda: cluster.requests_by(standby), timeout=15)
    cluster.kube.emulator.create_object(ISVC, isvc_with("one"))
    await eventually(deployment(cluster.kube, "one"), timeout=15)
    return leader, standby, lease


async def test_killed_leader_is_replaced_within_the_lease_bound(cluster):
    leader, standby, lease = await fast_pair(cluster)
    await asyncio.sleep(FAST.retry_period)  # the standby has seen a recent renewal
    leader.process.send_signal(signal.SIGKILL)  # no release, no goodbye
    killed = time.monotonic()
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))

    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    took_lease = time.monotonic() - killed
    await eventually(deployment(cluster.kube, "two"), timeout=15)
    acted = time.monotonic() - killed
    print(f"SIGKILL: lease taken after {took_lease:.2f}s, acting after {acted:.2f}s "
          f"(bound {FAST.takeover_bound:g}s + kopf start-up)")  # fmt: skip
    assert took_lease >= FAST.lease_duration - FAST.retry_period  # it waited out the lease
    assert took_lease <= FAST.takeover_bound + 1.0  # + scheduling on a busy machine
    assert acted <= FAST.takeover_bound + STARTUP_SLACK
    # (children are server-side applied: a PATCH creates them)
    assert "PATCH /apis/apps/v1/namespaces/default/deployments/two" in cluster.writes_by(standby)
    # The standby wrote nothing before it held the lease: its first write is after the kill.
    lease_obj = cluster.kube.emulator.get(LEASE, RELEASE_NS, lease)
    assert lease_obj["spec"]["leaseTransitions"] == 1


async def test_stopped_leader_hands_over_at_once(cluster):
    leader, _, lease = await fast_pair(cluster)
    leader.process.send_signal(signal.SIGTERM)  # a rollout or a drained node
    # kopf's shutdown comes first: it gives handlers still running (the creation of "one")
    # up to 5 s, and the leader renews meanwhile. The release is its last act before exit.
    assert await asyncio.wait_for(leader.process.wait(), timeout=15) == 0
    exited = time.monotonic()
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    took = time.monotonic() - exited
    print(f"SIGTERM: lease taken {took:.2f}s after the leader exited")
    # Released, not expired: an expiry would come a lease duration after the last renewal,
    # which was at most a retry period before the exit.
    assert took < FAST.lease_duration - FAST.retry_period
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))
    await eventually(deployment(cluster.kube, "two"), timeout=STARTUP_SLACK + 5)


async def test_leader_that_loses_its_lease_exits_before_the_new_holder_acts(cluster):
    leader, standby, lease = await fast_pair(cluster)

    def taken(obj: dict) -> None:  # another holder, as after a partition healed
        obj["spec"].update(holderIdentity="elsewhere", renewTime=micro_time())

    cluster.kube.emulator.mutate(LEASE, RELEASE_NS, lease, taken)
    lost = time.monotonic()
    assert await asyncio.wait_for(leader.process.wait(), timeout=10) == 1
    print(f"lease taken away: leader exited after {time.monotonic() - lost:.2f}s")
    assert time.monotonic() - lost <= 2 * FAST.retry_period + 1.0
    assert "lost the lease" in leader.log.read_text()
    # Nobody renews "elsewhere": the standby takes over once it expires, and acts.
    await eventually(lambda: cluster.holder(lease).startswith("kvfleet-b_"), timeout=15)
    cluster.kube.emulator.create_object(ISVC, isvc_with("two"))
    await eventually(deployment(cluster.kube, "two"), timeout=STARTUP_SLACK + 5)
    assert standby.process.returncode is None

"""Leader election on a Lease (operator/leader_election.py): the pure decision, then candidates
racing for one Lease on the emulator — never two holders, takeover after the lease expires,
at once after a release, and a holder that cannot renew steps down."""

from __future__ import annotations

import asyncio
import time

import kubernetes
import kubernetes_validate
import pytest
from kube_harness import LEASE, eventually
from kvfleet.operator.kube_api import KubeApi
from kvfleet.operator.leader_election import (
    LeaderElector,
    LeaseRecord,
    LeaseTiming,
    claim,
    lease_object,
    micro_time,
    run_while_leader,
)

NS, NAME = "kvfleet-system", "kvfleet-operator"
# Short, so the tests take seconds; the same ratios as the defaults (15 / 10 / 2).
FAST = LeaseTiming(lease_duration=2, renew_deadline=1.2, retry_period=0.2)
T0, T1 = "2025-01-01T00:00:00.000000Z", "2025-01-01T00:00:05.000000Z"


# --- the decision -------------------------------------------------------------------------------


def test_nobody_holds_it_so_we_take_it():
    assert claim(None, "a", valid=False, now=T0, duration=15) == LeaseRecord("a", 15, T0, T0, 0)


def test_the_holder_renews_keeping_its_acquire_time():
    held = LeaseRecord("a", 15, T0, T0, 3)
    assert claim(held, "a", valid=True, now=T1, duration=15) == LeaseRecord("a", 15, T0, T1, 3)


def test_another_holders_valid_lease_is_respected():
    assert claim(LeaseRecord("b", 15, T0, T0, 3), "a", valid=True, now=T1, duration=15) is None


def test_an_expired_lease_is_taken_over_with_a_transition():
    taken = claim(LeaseRecord("b", 15, T0, T0, 3), "a", valid=False, now=T1, duration=15)
    assert taken == LeaseRecord("a", 15, T1, T1, 4)


def test_a_released_lease_is_taken_at_once():
    released = LeaseRecord("", 1, T0, T0, 3)
    assert claim(released, "a", valid=True, now=T1, duration=15) == LeaseRecord("a", 15, T1, T1, 4)


def test_the_lease_written_is_a_valid_kubernetes_lease():
    record = claim(None, "kvfleet-0_1234", valid=False, now=micro_time(), duration=15)
    lease = lease_object(NS, NAME, record)
    kubernetes_validate.validate(lease, kubernetes_validate.latest_version(), strict=True)
    assert LeaseRecord.from_spec(lease["spec"]) == record


@pytest.mark.parametrize(
    "timing,field",
    [
        (LeaseTiming(15, 10, 0), "retry period"),
        (LeaseTiming(15, 2, 2), "renew deadline"),
        (LeaseTiming(10, 10, 2), "lease duration"),
    ],
)
def test_timings_that_could_give_two_leaders_are_refused(timing, field):
    with pytest.raises(ValueError, match=field):
        timing.check()


def test_the_default_takeover_bound():
    assert LeaseTiming().check().takeover_bound == 19


# --- candidates on the emulator -----------------------------------------------------------------


def candidate(identity: str, timing: LeaseTiming = FAST) -> LeaderElector:
    return LeaderElector(KubeApi.from_environment(), NS, NAME, identity, timing.check())


def holder(kube) -> str | None:
    lease = kube.emulator.get(LEASE, NS, NAME)
    return lease["spec"].get("holderIdentity") if lease else None


async def test_two_candidates_never_both_hold_the_lease(kube):
    a, b = candidate("a"), candidate("b")
    for _ in range(20):
        # Interleaved as two replicas would be; each answer is checked against the Lease.
        results = await asyncio.gather(
            asyncio.to_thread(a.try_acquire_or_renew), asyncio.to_thread(b.try_acquire_or_renew)
        )
        assert results.count(True) == 1, results
        winner = "a" if results[0] else "b"
        assert holder(kube) == winner
    lease = kube.emulator.get(LEASE, NS, NAME)
    assert lease["spec"]["leaseTransitions"] == 0  # the first winner kept it throughout
    assert lease["spec"]["leaseDurationSeconds"] == FAST.lease_duration


async def test_a_holder_that_stops_renewing_is_replaced_after_the_lease_expires(kube):
    a, b = candidate("a"), candidate("b")
    assert await asyncio.to_thread(a.try_acquire_or_renew)
    stopped = time.monotonic()  # "a" dies here: no renewal, no release
    await b.acquire()
    took = time.monotonic() - stopped
    assert FAST.lease_duration <= took <= FAST.takeover_bound + 1.0, took
    assert holder(kube) == "b" and b.is_leader
    assert kube.emulator.get(LEASE, NS, NAME)["spec"]["leaseTransitions"] == 1
    # The old holder, back from a pause, finds the lease taken and does not take it back.
    assert not await asyncio.to_thread(a.try_acquire_or_renew)


async def test_a_released_lease_is_taken_within_one_retry_period(kube):
    a, b = candidate("a"), candidate("b")
    assert await asyncio.to_thread(a.try_acquire_or_renew)
    assert not await asyncio.to_thread(b.try_acquire_or_renew)
    await asyncio.to_thread(a.release)
    assert holder(kube) == "" and not a.is_leader
    started = time.monotonic()
    await b.acquire()
    assert time.monotonic() - started < FAST.lease_duration / 2  # its first try: no waiting
    assert holder(kube) == "b"


async def test_a_renewal_still_in_flight_never_undoes_a_release(kube):
    # A stopping holder cancels its renewal task, but the renewal's thread may still run.
    a = candidate("a")
    assert await asyncio.to_thread(a.try_acquire_or_renew)
    racing = [asyncio.to_thread(a.try_acquire_or_renew) for _ in range(4)]
    await asyncio.gather(*racing, asyncio.to_thread(a.release))
    assert holder(kube) == ""
    assert not await asyncio.to_thread(a.try_acquire_or_renew)  # released is final


async def test_a_holder_whose_lease_is_taken_steps_down_within_a_retry_period(kube):
    a = candidate("a")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    await asyncio.sleep(3 * FAST.retry_period)
    assert not holding.done() and holder(kube) == "a"  # renewing all along

    def intruder(lease):
        lease["spec"].update(holderIdentity="z", renewTime=micro_time())

    kube.emulator.mutate(LEASE, NS, NAME, intruder)
    started = time.monotonic()
    await asyncio.wait_for(holding, timeout=2 * FAST.retry_period + 0.5)
    assert time.monotonic() - started <= 2 * FAST.retry_period + 0.5
    assert not a.is_leader and holder(kube) == "z"


async def test_a_holder_that_cannot_renew_steps_down_before_anyone_may_take_over(kube):
    a = candidate("a")
    await a.acquire()
    last_renewal = time.monotonic()

    # The API server goes out of reach (a partition): every renewal fails.
    unreachable = kubernetes.client.Configuration()
    unreachable.host = "http://127.0.0.1:9"
    a.api = KubeApi(kubernetes.client.ApiClient(unreachable))
    await asyncio.wait_for(a.hold(), timeout=FAST.lease_duration)
    gave_up = time.monotonic() - last_renewal
    # Stopped within the renew deadline, so before a standby could take the lease over.
    assert gave_up <= FAST.renew_deadline + 0.2 < FAST.lease_duration
    assert not a.is_leader


async def test_run_while_leader_acts_only_while_holding_and_releases_at_the_end(kube):
    a, b = candidate("a"), candidate("b")
    acting: list[str] = []
    done = asyncio.Event()

    def lead(name: str):
        async def act() -> None:
            acting.append(name)
            await done.wait()

        return act

    first = asyncio.create_task(run_while_leader(a, lead("a"), lambda: acting.append("lost a")))
    await eventually(lambda: acting == ["a"], timeout=5)
    second = asyncio.create_task(run_while_leader(b, lead("b"), lambda: acting.append("lost b")))
    await asyncio.sleep(FAST.lease_duration + FAST.retry_period)
    assert acting == ["a"]  # "a" renews, so "b" waits however long
    done.set()  # "a" stops gracefully and releases: "b" takes over at once and acts
    await first
    # Released, not expired: well within a lease duration (one retry period, give or take load).
    await eventually(lambda: acting == ["a", "b"], timeout=FAST.lease_duration - 0.5)
    await second
    assert holder(kube) == ""  # "b" released too

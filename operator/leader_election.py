"""Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's leaderelection
package (and so controller-runtime) does it, so that of several operator replicas exactly one
acts at a time.

The Lease's spec is the record: `holderIdentity`, `leaseDurationSeconds`, `acquireTime`,
`renewTime`, `leaseTransitions`. Every write is a PUT carrying the resourceVersion that was
read (a create for the first one), so two replicas racing for the same Lease cannot both win:
the API server answers the slower one 409.

- A candidate reads the Lease every `retry_period`. It takes it when nobody holds it (no Lease,
  or an empty holder after a graceful release) or when the record has not changed for
  `leaseDurationSeconds` *as measured on the candidate's own clock* since it first saw that
  record. Timestamps inside the record are never compared with the local clock, so clock skew
  between nodes does not matter (only clock rate does).
- The holder renews every `retry_period`. When no renewal has succeeded for `renew_deadline`,
  counted from the moment the last successful renewal was *sent*, it has lost the lease and must
  stop acting at once. A candidate takes over at the earliest `leaseDurationSeconds` after it
  saw that renewal, which the server stored after it was sent; with
  renew_deadline < lease_duration the old holder has stopped before anyone else starts.
- On a graceful exit the holder releases the lease (empty holder, 1 s duration) so a standby
  takes over within one `retry_period` instead of a full lease duration.

Bound on a takeover after the holder dies without releasing: a standby saw the last renewal at
most `retry_period` after it was written, waits `lease_duration` from then, and tries again at
most `retry_period` later: lease_duration + 2 × retry_period (19 s with the defaults 15/10/2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.kube_api import KubeApi, KubeApiError

log = logging.getLogger("kvfleet.leader")

LEASES = ("coordination.k8s.io", "v1", "leases")
RELEASED_LEASE_SECONDS = 1  # what client-go writes on release


@dataclass(slots=True, frozen=True)
class LeaseTiming:
    """client-go's three durations (controller-runtime's defaults: 15 s, 10 s, 2 s)."""

    lease_duration: int = 15  # seconds a standby waits on an unchanged record (an int32 field)
    renew_deadline: float = 10.0  # the holder gives up when it could not renew for this long
    retry_period: float = 2.0  # between two attempts, to acquire or to renew

    def check(self) -> LeaseTiming:
        """Raise ValueError naming the setting when the durations cannot keep one leader."""
        if self.retry_period <= 0:
            raise ValueError(f"retry period: must be > 0 seconds, got {self.retry_period:g}")
        if self.renew_deadline <= self.retry_period:
            raise ValueError(
                f"renew deadline: must be > the retry period ({self.retry_period:g} s), "
                f"got {self.renew_deadline:g}"
            )
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(
                f"lease duration: must be > the renew deadline ({self.renew_deadline:g} s), "
                f"got {self.lease_duration}"
            )
        return self

    @property
    def takeover_bound(self) -> float:
        """Seconds until a standby holds the lease after the holder died without releasing it."""
        return self.lease_duration + 2 * self.retry_period


@dataclass(slots=True, frozen=True)
class LeaseRecord:
    """A Lease's spec as the election reads and writes it."""

    holder: str = ""
    lease_duration_seconds: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> LeaseRecord:
        """The record in a Lease's spec (missing fields read as a released lease)."""
        spec = spec or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def to_spec(self) -> dict[str, Any]:
        """The Lease spec for this record."""
        spec: dict[str, Any] = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration_seconds,
            "leaseTransitions": self.transitions,
        }
        if self.acquire_time:
            spec["acquireTime"] = self.acquire_time
        if self.renew_time:
            spec["renewTime"] = self.renew_time
        return spec


def micro_time(at: datetime.datetime | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC), as Lease timestamps are."""
    at = at or datetime.datetime.now(datetime.UTC)
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claim(
    observed: LeaseRecord | None, identity: str, *, valid: bool, now: str, duration: int
) -> LeaseRecord | None:
    """The record that makes `identity` the holder from `now`, or None while another holder's
    lease is valid. `valid`: the observed record has stayed unchanged for less than its
    leaseDurationSeconds on our clock. Pure: the election's whole decision."""
    if observed is None:
        return LeaseRecord(identity, duration, now, now, 0)
    if observed.holder == identity:
        return dataclasses.replace(observed, lease_duration_seconds=duration, renew_time=now)
    if observed.holder and valid:
        return None
    return LeaseRecord(identity, duration, now, now, observed.transitions + 1)


def lease_object(namespace: str, name: str, record: LeaseRecord) -> dict[str, Any]:
    """A new Lease holding `record`."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace},
        "spec": record.to_spec(),
    }


@dataclass(slots=True)
class LeaderElector:
    """One candidate for one Lease. `try_acquire_or_renew` and `release` block (run them in a
    thread); `acquire` and `hold` are the loops around them. Once released, it never takes
    the lease again (a process that stepped down exits)."""

    api: KubeApi
    namespace: str
    name: str
    identity: str
    timing: LeaseTiming = dataclasses.field(default_factory=LeaseTiming)
    clock: Callable[[], float] = time.monotonic
    _observed_spec: dict[str, Any] | None = None
    _observed_at: float = 0.0
    _leader: bool = False
    _last_renewal_sent: float = 0.0
    # Threads of its own: a renewal must not queue behind the autoscaler's API calls in the
    # event loop's default pool, or a busy leader would give up a lease it could renew.
    _threads: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, "lease")
    )
    # One attempt at a time, and none once releasing: a renewal still in flight when the
    # holder stops (its task cancelled, its thread not) must not overwrite the release.
    _writing: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _released: bool = False

    @property
    def is_leader(self) -> bool:
        """Whether the last attempt left this candidate holding the lease."""
        return self._leader

    def _observe(self, spec: Mapping[str, Any], at: float) -> LeaseRecord:
        # The lease's age is counted from when *we* first saw this exact record.
        if dict(spec) != self._observed_spec:
            self._observed_spec = dict(spec)
            self._observed_at = at
        return LeaseRecord.from_spec(spec)

    def try_acquire_or_renew(self) -> bool:
        """One attempt: read the Lease and write ourselves into it when we may. True when we
        hold it afterwards."""
        with self._writing:
            if self._released:
                self._leader = False
                return False
            return self._try_acquire_or_renew()

    def _try_acquire_or_renew(self) -> bool:
        sent = self.clock()
        lease = self.api.get(LEASES, self.namespace, self.name)
        now = micro_time()
        duration = self.timing.lease_duration
        if lease is None:
            record = claim(None, self.identity, valid=False, now=now, duration=duration)
            assert record is not None
            try:
                created = self.api.create(
                    LEASES, self.namespace, lease_object(self.namespace, self.name, record)
                )
            except KubeApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    self._leader = False
                    return False
                raise
            return self._won(created, record, sent)
        observed = self._observe(lease.get("spec") or {}, self.clock())
        valid = self.clock() < self._observed_at + observed.lease_duration_seconds
        record = claim(observed, self.identity, valid=valid, now=now, duration=duration)
        if record is None:
            self._leader = False
            return False
        try:
            written = self.api.replace(LEASES, self.namespace, {**lease, "spec": record.to_spec()})
        except KubeApiError as exc:
            if exc.status == 409:  # someone wrote it since our read: read again next time
                self._leader = False
                return False
            raise
        return self._won(written, record, sent)

    def _won(self, written: Mapping[str, Any], record: LeaseRecord, sent: float) -> bool:
        if not self._leader:
            log.info(
                "%s holds lease %s/%s (transitions: %d)",
                self.identity,
                self.namespace,
                self.name,
                record.transitions,
            )
        self._observe(written.get("spec") or record.to_spec(), self.clock())
        self._leader = True
        self._last_renewal_sent = sent
        return True

    async def _attempt(self, timeout: float) -> bool:
        try:
            attempt = asyncio.get_running_loop().run_in_executor(
                self._threads, self.try_acquire_or_renew
            )
            return await asyncio.wait_for(attempt, timeout)
        except TimeoutError:
            log.warning("lease %s/%s: no answer within %.1fs", self.namespace, self.name, timeout)
        except Exception as exc:  # the API unreachable is a failed attempt, not a crash
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        return False

    async def acquire(self) -> None:
        """Return once this candidate holds the lease, trying every retry_period."""
        log.info("%s waits to hold lease %s/%s", self.identity, self.namespace, self.name)
        while not await self._attempt(self.timing.renew_deadline):
            await asyncio.sleep(self.timing.retry_period)

    async def hold(self) -> None:
        """Renew every retry_period while we hold the lease; return as soon as we do not any
        more: another holder took it, or no renewal succeeded within renew_deadline of the last
        successful one being sent. The caller must then stop acting at once."""
        why = f"no renewal succeeded within {self.timing.renew_deadline:g}s"
        while True:
            deadline = self._last_renewal_sent + self.timing.renew_deadline
            await asyncio.sleep(max(0.0, min(self.timing.retry_period, deadline - self.clock())))
            remaining = deadline - self.clock()
            if remaining <= 0:
                break
            if await self._attempt(remaining):
                continue
            holder = LeaseRecord.from_spec(self._observed_spec).holder
            if holder not in ("", self.identity):
                why = f"{holder} holds it now"
                break
        self._leader = False
        log.error("%s lost lease %s/%s: %s", self.identity, self.namespace, self.name, why)

    def release(self) -> None:
        """Give the lease up on a graceful exit, so a standby takes over within one retry
        period. Best effort: a failure only means the standby waits out the lease."""
        self._released = True
        with self._writing:
            self._leader = False
            self._release()

    def _release(self) -> None:
        try:
            lease = self.api.get(LEASES, self.namespace, self.name)
            if lease is None:
                return
            record = LeaseRecord.from_spec(lease.get("spec"))
            if record.holder != self.identity:
                return
            now = micro_time()
            released = LeaseRecord("", RELEASED_LEASE_SECONDS, now, now, record.transitions)
            self.api.replace(LEASES, self.namespace, {**lease, "spec": released.to_spec()})
            log.info("%s released lease %s/%s", self.identity, self.namespace, self.name)
        except Exception as exc:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)


async def run_while_leader(
    elector: LeaderElector,
    lead: Callable[[], Awaitable[None]],
    on_lost: Callable[[], None],
) -> None:
    """client-go's `Run`: wait for the lease, then run `lead()` while renewing it.

    When `lead()` returns (a graceful stop), the lease is released. When the lease is lost
    first, `on_lost()` is called at once and must end all acting (the CLI exits the process,
    as controller-runtime does); then `lead()` is cancelled.
    """
    await elector.acquire()
    # Both tasks exist before `lead()` first runs: kopf ignores tasks older than itself at exit.
    leading = asyncio.create_task(lead(), name="leading")
    holding = asyncio.create_task(elector.hold(), name="holding the lease")
    try:
        await asyncio.wait({leading, holding}, return_when=asyncio.FIRST_COMPLETED)
        if not leading.done():
            on_lost()
            leading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leading
            return
    finally:
        holding.cancel()
    await asyncio.to_thread(elector.release)
    leading.result()

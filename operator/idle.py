"""The idle clock of scale to zero: since when has an InferenceService had no request at all?

Pure: no I/O, no clock of its own. The autoscaler's loop calls `observe` once per poll with that
poll's `PodSample`s and keeps the returned `IdleClock` until the next poll; `decide_replicas`
(autoscaler.py) scales to 0 only when `idle_for` reaches spec.autoscaling.scaleToZeroAfterSeconds.

"No request" is known from the replicas themselves, the same numbers every runtime (kvfleet's
or vLLM's) serves: a poll sees activity when any pod has a request running or waiting
(`vllm:num_requests_running`, `vllm:num_requests_waiting`), or when a pod's count of finished
requests (`vllm:request_success_total`) moved since the previous poll, which catches requests
that started and ended between two polls. The router needs no counter of its own here: every
request it forwards lands on a replica and shows up in those numbers, and the requests it holds
while there is no replica are the ones that scale the Deployment up from zero, which this clock
counts as activity too.

What restarts the clock, besides requests:
- the autoscaler (re)starting (no clock yet): a restarted operator never scales to zero before
  it has watched a whole idle period itself;
- the Deployment going up from 0 replicas (the router's activator woke it for a request): the
  idle period counts from that scale-up, so the activator's replica is not removed under the
  request it was started for;
- a pod whose numbers cannot be read (not ready, no answer) or not created yet: it may be busy,
  and a pod we cannot read is never taken for an idle one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet.operator.autoscaler import PodSample


@dataclass(slots=True, frozen=True)
class IdleClock:
    """What one poll leaves for the next: when activity was last seen (and what it was), each
    pod's finished-requests count, and the Deployment's replicas at that poll."""

    last_activity: float
    activity: str
    replicas: int
    finished: Mapping[str, float] = field(default_factory=dict)

    def idle_for(self, now: float) -> float:
        """Seconds since the last activity (0 while something is going on)."""
        return max(0.0, now - self.last_activity)


def observe(
    clock: IdleClock | None, samples: Sequence[PodSample], current: int, now: float
) -> IdleClock:
    """The clock after one poll: `samples` one per pod, `current` the Deployment's replicas,
    `now` seconds on the caller's monotonic clock. See the module docstring for the rules."""
    finished = {s.pod: s.finished for s in samples if s.reporting}
    activity = _activity(clock, samples, current, finished)
    if activity:
        return IdleClock(now, activity, current, finished)
    assert clock is not None  # no clock is activity ("the autoscaler started")
    return IdleClock(clock.last_activity, clock.activity, current, finished)


def _activity(
    clock: IdleClock | None,
    samples: Sequence[PodSample],
    current: int,
    finished: Mapping[str, float],
) -> str:
    if clock is None:
        return "the autoscaler started"
    if clock.replicas == 0 and current > 0:
        return f"scaled up from zero to {current}"
    busy = [s for s in samples if s.reporting and (s.running > 0 or s.waiting > 0)]
    if busy:
        running = sum(s.running for s in busy)
        waiting = sum(s.waiting for s in busy)
        return f"{running:g} requests running, {waiting:g} waiting"
    unread = [s.pod for s in samples if not s.reporting]
    if unread:
        return f"no metrics from {', '.join(sorted(unread))}"
    if current > len(samples):
        return f"{current - len(samples)} pods not created yet"
    moved = [
        pod
        for pod, total in finished.items()
        # A pod not seen before counts when it has finished any request: it served one since.
        if total != clock.finished.get(pod, 0.0)
    ]
    if moved:
        return f"requests finished on {', '.join(sorted(moved))}"
    return ""

"""The autoscaling decision: how many replicas an InferenceService should run, and why.

Pure: no I/O, no clock, no Kubernetes. The kopf timer gathers `PodSample`s (metrics_source.py),
calls `decide_replicas` with the history it kept from the previous poll, and applies the result.
The algorithm is explained for platform engineers in docs/autoscaling.md.

Signals (from the runtime's own /metrics, vLLM's names):
- queue: total `vllm:num_requests_waiting` over the pods that answered;
  needs ceil(total waiting / targetQueueDepth) replicas.
- KV cache: mean `vllm:kv_cache_usage_perc` over the pods that answered;
  needs ceil(current × mean usage / targetKVCacheUsage) replicas.

Rules, in the order they apply:
1. The replica count is brought inside [minReplicas, maxReplicas] at once if it is outside
   (someone edited the bounds or scaled the Deployment by hand). With no pod there is no
   signal: at 0 replicas and minReplicas 0 the count stays 0 until the router's activator
   (runtime/router/activator.py) scales it to 1 for a request.
2. Each signal whose ratio (value / target) lies within 0.9..1.1 proposes "no change";
   the recommendation is the largest proposal, clamped to [max(1, minReplicas), maxReplicas]:
   load signals never ask for 0 replicas.
2b. Scale to zero (minReplicas 0): to 0 from any count once `idle_for` (idle.py: seconds with
   no request running, waiting or finished on any pod) reaches scaleToZeroAfterSeconds, and
   only while every pod reports and nothing runs or waits.
3. Up: to the lowest recommendation of the last scaleUpStabilizationSeconds (0 = at once),
   at most doubling (and at least +1) per poll.
4. Down: only to the highest recommendation of the last scaleDownStabilizationSeconds, and
   never while any pod is not ready or did not answer: a pod we cannot read is not an idle pod.
   A scale-up still happens on the pods that answered (their queue is a lower bound of the load).
   Bounded: a pod without data for more than STALE_AFTER_POLLS consecutive polls (stuck
   starting, unschedulable, /metrics broken) stops holding scale-downs back; otherwise one such
   pod would pin the replica count forever. It still shows in the reason and AutoscalerReady.
5. One decision per poll, so at most one change per poll.

History is an immutable tuple of `Recommendation`s; the Decision carries the updated history,
trimmed to the longer window, and how many polls in a row each pod has been missing, for the
caller to keep until the next poll. An empty history
means the autoscaler just (re)started: it is seeded with the current replica count, so a
restarted operator never scales down before it has watched a full scale-down window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvfleet.operator.spec import AutoscalingSpec

# HPA's default tolerance: a signal within ±10% of its target causes no change.
TOLERANCE = 0.1
# Replica arithmetic happens on floats (e.g. 3 × 0.7 / 0.7); without this, 2.0000000000000004
# would ceil to 3.
_FLOAT_SLACK = 1e-9
# A pod missing data for more polls in a row than this no longer blocks a scale-down (rule 4):
# 75 s at the default 15 s poll — longer than a restart or a slow scrape, shorter than a stuck
# pod is worth paying a GPU for.
STALE_AFTER_POLLS = 5
# Stands for the pods the Deployment wants that are not listed yet (they have no name).
NOT_CREATED = "(pods not created yet)"


@dataclass(slots=True, frozen=True)
class PodSample:
    """What one pod reported on one poll. `scraped` False: no data (`error` says why)."""

    pod: str
    ready: bool
    scraped: bool
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    finished: float = 0.0  # vllm:request_success_total: requests this pod has finished, ever
    error: str = ""

    @property
    def reporting(self) -> bool:
        """True when this pod's numbers count: ready and answered."""
        return self.ready and self.scraped


@dataclass(slots=True, frozen=True)
class Recommendation:
    """The replica count one poll recommended (before stabilization), and when."""

    at: float
    replicas: int


History = tuple[Recommendation, ...]


@dataclass(slots=True, frozen=True)
class Decision:
    """The outcome of one poll: `desired` replicas, a human-readable `reason`, the updated
    `history` to keep, and the numbers behind it (for status and Events)."""

    desired: int
    reason: str
    history: History
    current: int
    recommendation: int
    total_waiting: float
    total_running: float
    mean_kv_usage: float | None  # None when no pod answered
    pods_reporting: int
    pods_missing: int  # not ready, not answering, or not created yet
    # Missing for more than STALE_AFTER_POLLS polls, so not holding a scale-down back.
    pods_ignored: tuple[str, ...] = ()
    # Polls in a row each missing pod has been missing, for the next call.
    missing_polls: Mapping[str, int] = field(default_factory=dict)

    @property
    def direction(self) -> Literal["up", "down", "none"]:
        """Which way this decision scales (for the ScaledUp / ScaledDown Event)."""
        if self.desired > self.current:
            return "up"
        if self.desired < self.current:
            return "down"
        return "none"


def decide_replicas(
    samples: Sequence[PodSample],
    current: int,
    spec: AutoscalingSpec,
    history: History,
    now: float,
    missing_polls: Mapping[str, int] | None = None,
    idle_for: float | None = None,
) -> Decision:
    """Decide the replica count for one poll; see the module docstring for the rules.

    `samples`: one per pod of the Deployment (ready or not); `current`: the Deployment's
    replicas now; `history`: the previous Decision's history (empty on the first poll);
    `now`: seconds on any monotonic clock the caller keeps using; `missing_polls`: the previous
    Decision's `missing_polls` (empty on the first poll); `idle_for`: seconds without any
    request (idle.IdleClock.idle_for), None when not known (no scale to zero then).
    """
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    before = missing_polls or {}
    reporting = [s for s in samples if s.reporting]
    # Pods the Deployment wants but that are not even listed yet count as missing too: a
    # scale-up in progress must not look like idle capacity.
    not_created = max(0, current - len(samples))
    missing = len(samples) - len(reporting) + not_created
    absent = [s.pod for s in samples if not s.reporting] + ([NOT_CREATED] if not_created else [])
    streaks = {name: before.get(name, 0) + 1 for name in absent}
    ignored = tuple(sorted(name for name, n in streaks.items() if n > STALE_AFTER_POLLS))
    blocking = missing - len(ignored) - (not_created - 1 if NOT_CREATED in ignored else 0)
    total_waiting = sum(s.waiting for s in reporting)
    total_running = sum(s.running for s in reporting)
    mean_kv = sum(s.kv_usage for s in reporting) / len(reporting) if reporting else None

    signals = _signals(total_waiting, mean_kv, current, spec) if reporting and current else []
    proposed = max((s.proposal for s in signals), default=current)
    recommendation = _clamp(proposed, spec)
    # While data is missing we cannot justify fewer replicas than now; recording the lower
    # number would let it end a later scale-down window early.
    recorded = _clamp(max(recommendation, current), spec) if blocking else recommendation

    if not history:
        history = (Recommendation(now, current),)
    up_floor = min(
        [r.replicas for r in _within(history, now, spec.scale_up_stabilization_seconds)]
        + [recorded]
    )
    down_ceiling = max(
        [r.replicas for r in _within(history, now, spec.scale_down_stabilization_seconds)]
        + [recorded]
    )
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    kept = [r for r in history if r.at >= now - keep]
    new_history = (*kept, Recommendation(now, recorded))

    if _idle_long_enough(spec, current, idle_for, missing, total_waiting, total_running):
        assert idle_for is not None
        desired, reason = (
            0,
            (
                f"no requests for {idle_for:.0f}s (scaleToZeroAfterSeconds "
                f"{spec.scale_to_zero_after_seconds}): scaling {current} → 0"
            ),
        )
    else:
        desired, reason = _choose(
            current,
            recommendation,
            up_floor,
            down_ceiling,
            signals,
            _Missing(missing, blocking, ignored),
            len(samples),
            spec,
        )
    return Decision(
        desired=desired,
        reason=reason,
        history=new_history,
        current=current,
        recommendation=recommendation,
        total_waiting=total_waiting,
        total_running=total_running,
        mean_kv_usage=mean_kv,
        pods_reporting=len(reporting),
        pods_missing=missing,
        pods_ignored=ignored,
        missing_polls=streaks,
    )


@dataclass(slots=True, frozen=True)
class _Missing:
    count: int  # pods without data this poll
    blocking: int  # of which still hold a scale-down back
    ignored: tuple[str, ...]  # the others: missing for more than STALE_AFTER_POLLS polls


@dataclass(slots=True, frozen=True)
class _Signal:
    proposal: int  # replicas this signal asks for; `current` when within tolerance
    ratio: float  # value / target
    text: str  # "queue 14 waiting over 2 replicas > target 4 per replica"


def _signals(
    total_waiting: float, mean_kv: float | None, current: int, spec: AutoscalingSpec
) -> list[_Signal]:
    queue_needed = total_waiting / spec.target_queue_depth
    queue_ratio = queue_needed / current
    replicas = "replica" if current == 1 else "replicas"
    queue = _Signal(
        proposal=_propose(queue_needed, queue_ratio, current),
        ratio=queue_ratio,
        text=(
            f"queue {total_waiting:g} waiting over {current} {replicas} "
            f"{_compare(queue_ratio)} target {spec.target_queue_depth:g} per replica"
        ),
    )
    kv_usage = mean_kv or 0.0
    kv_ratio = kv_usage / spec.target_kv_cache_usage
    kv = _Signal(
        proposal=_propose(current * kv_ratio, kv_ratio, current),
        ratio=kv_ratio,
        text=(
            f"KV cache {_percent(kv_usage)} {_compare(kv_ratio)} "
            f"target {_percent(spec.target_kv_cache_usage)}"
        ),
    )
    return [queue, kv]


def _propose(needed: float, ratio: float, current: int) -> int:
    if abs(ratio - 1) <= TOLERANCE + _FLOAT_SLACK:
        return current
    return max(0, math.ceil(needed - _FLOAT_SLACK))


def _compare(ratio: float) -> str:
    if abs(ratio - 1) <= TOLERANCE + _FLOAT_SLACK:
        return "≈"
    return ">" if ratio > 1 else "<"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _clamp(replicas: int, spec: AutoscalingSpec) -> int:
    # At least 1: going to 0 is the idle rule's alone (2b), never a load signal's.
    return min(max(replicas, spec.min_replicas, 1), spec.max_replicas)


def _idle_long_enough(
    spec: AutoscalingSpec,
    current: int,
    idle_for: float | None,
    missing: int,
    total_waiting: float,
    total_running: float,
) -> bool:
    """Rule 2b: whether the last replicas may go."""
    return (
        spec.min_replicas == 0
        and current > 0
        and idle_for is not None
        and idle_for >= spec.scale_to_zero_after_seconds
        and missing == 0
        and total_waiting == 0
        and total_running == 0
    )


def _within(history: History, now: float, window: float) -> list[Recommendation]:
    # Strictly inside the window, so a 0-second window holds only this poll's recommendation.
    return [r for r in history if r.at > now - window]


def _choose(
    current: int,
    recommendation: int,
    up_floor: int,
    down_ceiling: int,
    signals: list[_Signal],
    absent: _Missing,
    pods: int,
    spec: AutoscalingSpec,
) -> tuple[int, str]:
    if current < spec.min_replicas:
        return spec.min_replicas, (
            f"{current} replicas is below minReplicas {spec.min_replicas}: "
            f"scaling {current} → {spec.min_replicas}"
        )
    if current > spec.max_replicas:
        return spec.max_replicas, (
            f"{current} replicas is above maxReplicas {spec.max_replicas}: "
            f"scaling {current} → {spec.max_replicas}"
        )
    if current == 0:
        return 0, ("scaled to zero: the router's activator starts a replica on the next request")
    if not signals:
        return current, f"metrics missing from all {max(pods, current)} pods: holding at {current}"
    missing = absent.count
    missing_note = f"metrics missing from {missing} of {max(pods, current)} pods" if missing else ""
    if absent.ignored:
        missing_note += (
            f" ({', '.join(absent.ignored)}: missing for more than {STALE_AFTER_POLLS} polls, "
            "ignored)"
        )

    if recommendation > current:
        drivers = "; ".join(s.text for s in signals if s.proposal > current)
        if missing_note:
            drivers = f"{drivers} ({missing_note}: scaling on the pods that answered)"
        if up_floor <= current:
            return current, (
                f"{drivers}; scale-up held: lowest recommendation in last "
                f"{spec.scale_up_stabilization_seconds:g}s is {up_floor}"
            )
        step_limit = max(2 * current, current + 1)
        desired = min(up_floor, step_limit)
        note = ""
        if desired < recommendation:
            note = f" (recommended {recommendation}"
            note += "; at most doubling per step)" if desired == step_limit else ")"
        if desired == spec.max_replicas and desired < max(s.proposal for s in signals):
            note += f" (capped at maxReplicas {spec.max_replicas})"
        return desired, f"{drivers}: scaling {current} → {desired}{note}"

    if recommendation < current:
        load = "; ".join(s.text for s in signals)
        if absent.blocking:
            return current, f"{missing_note}: not scaling down ({load})"
        if missing_note:
            load = f"{load} ({missing_note})"
        if down_ceiling >= current:
            return current, (
                f"{load}; scale-down held: highest recommendation in last "
                f"{spec.scale_down_stabilization_seconds:g}s is {down_ceiling}"
            )
        return down_ceiling, f"{load}: scaling {current} → {down_ceiling}"

    load = "; ".join(s.text for s in signals)
    if missing_note:
        load = f"{load} ({missing_note})"
    return current, f"{load}: holding at {current}"

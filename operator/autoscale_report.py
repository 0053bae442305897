"""What one autoscaler poll found, in the shapes it is reported in: the `PollReport` observers
get, the AutoscalerReady condition, `status.autoscaling` and the ScaledUp/ScaledDown Event.

Pure: built from the poll's samples and decision (autoscaler.py); autoscale_poll.py writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.operator import conditions as c
from kvfleet.operator.autoscaler import STALE_AFTER_POLLS, Decision, PodSample
from kvfleet.operator.isvc_events import isvc_event

AUTOSCALER_READY = "AutoscalerReady"
SCALED_UP, SCALED_DOWN = "ScaledUp", "ScaledDown"
SCALED_TO_ZERO = "ScaledToZero"  # the Event and AutoscalerReady reason at 0 replicas
MAX_ERRORS_SHOWN = 3


@dataclass(slots=True, frozen=True)
class PollReport:
    """What one poll saw and did, for observers (the demo) and logs."""

    namespace: str
    name: str
    at: float  # time.time()
    current: int
    desired: int  # what the decision asked for
    scaled: bool  # whether the Deployment was changed to it
    reason: str
    total_waiting: float
    total_running: float
    mean_kv_usage: float | None
    pods_reporting: int
    pods_missing: int
    ready: c.Condition


def readiness(
    samples: Sequence[PodSample], decision: Decision | None, error: str = ""
) -> c.Condition:
    """The AutoscalerReady condition for one poll's outcome."""
    if error:
        return c.Condition(AUTOSCALER_READY, c.FALSE, "PrometheusUnavailable", error)
    failed = [s for s in samples if s.ready and not s.scraped]
    if failed:
        shown = "; ".join(f"{s.pod}: {s.error}" for s in failed[:MAX_ERRORS_SHOWN])
        extra = len(failed) - MAX_ERRORS_SHOWN
        more = f" (and {extra} more)" if extra > 0 else ""
        ignored = set(decision.pods_ignored) if decision else set()
        if all(s.pod in ignored for s in failed):
            consequence = (
                f"unreadable for more than {STALE_AFTER_POLLS} polls, so no longer holding "
                "replicas up"
            )
        else:
            consequence = "so replicas will not go down"
        return c.Condition(
            AUTOSCALER_READY,
            c.FALSE,
            "MetricsUnavailable",
            f"metrics of {len(failed)} of {len(samples)} pods could not be read, {consequence}: "
            f"{shown}{more}",
        )
    if decision is not None and decision.current == decision.desired == 0:
        return c.Condition(AUTOSCALER_READY, c.TRUE, SCALED_TO_ZERO, decision.reason)
    if not any(s.reporting for s in samples):
        return c.Condition(
            AUTOSCALER_READY,
            c.FALSE,
            "NoReadyPods",
            "no pod is ready to report load yet; holding replicas",
        )
    return c.Condition(
        AUTOSCALER_READY, c.TRUE, "MetricsAvailable", decision.reason if decision else ""
    )


def autoscaling_status(
    decision: Decision, last_scale_time: str | None
) -> dict[str, int | float | str]:
    """`status.autoscaling` as the CRD describes it (queue depth per reporting replica)."""
    status: dict[str, int | float | str] = {
        "desiredReplicas": decision.desired,
        "currentReplicas": decision.current,
    }
    if decision.pods_reporting:
        status["queueDepth"] = round(decision.total_waiting / decision.pods_reporting, 3)
    if decision.mean_kv_usage is not None:
        status["kvCacheUsage"] = round(decision.mean_kv_usage, 4)
    if last_scale_time:
        status["lastScaleTime"] = last_scale_time
    return status


def scale_event(isvc: Mapping[str, Any], reason: str, message: str, now: str) -> dict[str, Any]:
    """The Normal Event of a scale the autoscaler made."""
    return isvc_event(isvc, "Normal", reason, message, now, "autoscaler")

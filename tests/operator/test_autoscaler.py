"""decide_replicas and AutoscalingSpec: examples a platform engineer would recognise, and
properties that must hold for any load (hypothesis)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.operator.autoscaler import (
    NOT_CREATED,
    STALE_AFTER_POLLS,
    Decision,
    PodSample,
    Recommendation,
    decide_replicas,
)
from kvfleet.operator.spec import AutoscalingSpec, SpecError, parse_autoscaling


def autoscaling(raw: dict | None) -> AutoscalingSpec:
    """`spec.autoscaling` as the autoscaler reads it: parsed, then checked."""
    return parse_autoscaling(raw).check()


SPEC = autoscaling({"enabled": True})  # the CRD defaults: 1..4, queue 4, KV 80%


def pod(name: str, waiting: float = 0, kv: float = 0.0, *, ready=True, scraped=True) -> PodSample:
    return PodSample(name, ready=ready, scraped=scraped, waiting=waiting, running=1, kv_usage=kv)


def pods(n: int, waiting: float = 0, kv: float = 0.0) -> list[PodSample]:
    """n pods sharing `waiting` requests evenly, each at KV usage `kv`."""
    return [pod(f"p{i}", waiting / n, kv) for i in range(n)]


def run_polls(
    load, spec: AutoscalingSpec, start: int, polls: int, interval: float | None = None
) -> list[Decision]:
    """Feed decide_replicas its own output, like the operator's timer does; `load(replicas)`
    gives the samples the pods would report at that replica count."""
    interval = spec.poll_interval_seconds if interval is None else interval
    current, history, missing, decisions = start, (), {}, []
    for i in range(polls):
        decision = decide_replicas(load(current), current, spec, history, i * interval, missing)
        decisions.append(decision)
        current, history, missing = decision.desired, decision.history, decision.missing_polls
    return decisions


def first_change(decisions: list[Decision]) -> int | None:
    """The index of the first poll that changed the replica count."""
    return next((i for i, d in enumerate(decisions) if d.desired != d.current), None)


# --- the spec -------------------------------------------------------------------------------


def test_spec_defaults_match_the_crd():
    spec = autoscaling(None)
    assert (spec.enabled, spec.min_replicas, spec.max_replicas) == (False, 1, 4)
    assert (spec.target_queue_depth, spec.target_kv_cache_usage) == (4, 0.8)
    assert spec.scale_up_stabilization_seconds == 0
    assert spec.scale_down_stabilization_seconds == 300
    assert spec.poll_interval_seconds == 15
    assert (spec.metrics_source, spec.prometheus_url) == ("scrape", None)


def test_spec_defaults_are_the_crd_schema_defaults():
    crd = yaml.safe_load(
        (Path(__file__).parents[2] / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = schema["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    from_crd = {k: v["default"] for k, v in fields.items() if "default" in v}
    assert autoscaling(from_crd) == autoscaling({})
    assert set(from_crd) >= {"minReplicas", "maxReplicas", "scaleDownStabilizationSeconds"}


def test_spec_reads_camel_case_fields():
    spec = autoscaling(
        {
            "enabled": True,
            "minReplicas": 2,
            "maxReplicas": 8,
            "targetQueueDepth": 2.5,
            "targetKVCacheUsage": 0.7,
            "scaleUpStabilizationSeconds": 30,
            "scaleDownStabilizationSeconds": 60,
            "pollIntervalSeconds": 5,
            "metricsSource": "prometheus",
            "prometheusURL": "http://prometheus.monitoring:9090",
        }
    )
    assert spec.min_replicas == 2 and spec.max_replicas == 8
    assert spec.target_queue_depth == 2.5 and spec.target_kv_cache_usage == 0.7
    assert spec.scale_up_stabilization_seconds == 30
    assert spec.scale_down_stabilization_seconds == 60
    assert spec.poll_interval_seconds == 5
    assert spec.prometheus_url == "http://prometheus.monitoring:9090"


@pytest.mark.parametrize(
    ("raw", "field", "limit"),
    [
        ({"minReplicas": -1}, "minReplicas", ">= 0"),
        ({"maxReplicas": 0, "minReplicas": 0}, "maxReplicas", ">= 1"),
        ({"scaleToZeroAfterSeconds": 0}, "scaleToZeroAfterSeconds", ">= 1 second"),
        (
            {"minReplicas": 0, "pollIntervalSeconds": 30, "scaleToZeroAfterSeconds": 10},
            "scaleToZeroAfterSeconds",
            ">= pollIntervalSeconds (30)",
        ),
        ({"minReplicas": 3, "maxReplicas": 2}, "maxReplicas", ">= minReplicas (3)"),
        ({"maxReplicas": "4"}, "maxReplicas", "integer"),
        ({"minReplicas": True}, "minReplicas", "integer"),
        ({"targetQueueDepth": 0}, "targetQueueDepth", "> 0"),
        ({"targetKVCacheUsage": 1.5}, "targetKVCacheUsage", "<= 1"),
        ({"targetKVCacheUsage": 0}, "targetKVCacheUsage", "> 0"),
        ({"scaleDownStabilizationSeconds": -1}, "scaleDownStabilizationSeconds", ">= 0"),
        ({"scaleUpStabilizationSeconds": -5}, "scaleUpStabilizationSeconds", ">= 0"),
        ({"pollIntervalSeconds": 0}, "pollIntervalSeconds", ">= 1"),
        ({"metricsSource": "datadog"}, "metricsSource", "scrape, prometheus"),
        ({"metricsSource": "prometheus"}, "prometheusURL", "required"),
        ({"prometheusURL": "prometheus:9090"}, "prometheusURL", "http://"),
        ({"enabled": "yes"}, "enabled", "a boolean"),
        ({"pollIntervalSeconds": 2.5}, "pollIntervalSeconds", "an integer"),
        ({"targetQueueDepth": math.nan}, "targetQueueDepth", "a number"),
    ],
)
def test_spec_errors_name_the_field_and_the_limit(raw, field, limit):
    with pytest.raises(SpecError) as error:
        autoscaling(raw)
    assert error.value.field == f"spec.autoscaling.{field}"
    assert f"spec.autoscaling.{field}" in str(error.value)
    assert limit in str(error.value)


def test_spec_null_and_empty_url_mean_unset():
    spec = autoscaling({"minReplicas": None, "prometheusURL": ""})
    assert spec.min_replicas == 1 and spec.prometheus_url is None


# --- examples -------------------------------------------------------------------------------


def test_queue_above_target_scales_up_at_once_with_reason():
    decision = decide_replicas([pod("a", 10), pod("b", 4)], 2, SPEC, (), now=0)
    assert decision.desired == 4 and decision.direction == "up"
    assert "queue 14 waiting over 2 replicas > target 4 per replica" in decision.reason
    assert "2 → 4" in decision.reason


def test_kv_cache_above_target_scales_up():
    decision = decide_replicas([pod("a", 0, 0.93)], 1, SPEC, (), now=0)
    assert decision.desired == 2
    assert "KV cache 93% > target 80%" in decision.reason


def test_scale_up_at_most_doubles_per_poll():
    spec = autoscaling({"maxReplicas": 16})
    decision = decide_replicas([pod("a", 40)], 1, spec, (), now=0)
    assert decision.recommendation == 10
    assert decision.desired == 2
    assert "at most doubling" in decision.reason


def test_scale_up_is_capped_at_max_replicas():
    decision = decide_replicas(pods(3, waiting=60), 3, SPEC, (), now=0)
    assert decision.desired == 4
    assert "maxReplicas 4" in decision.reason


@pytest.mark.parametrize("waiting", [3.6, 4.0, 4.4])
def test_within_tolerance_band_nothing_changes(waiting):
    # One replica, target 4 waiting: 3.6..4.4 is within ±10%, even though ceil(4.4/4) = 2.
    decision = decide_replicas([pod("a", waiting, 0.5)], 1, SPEC, (), now=0)
    assert decision.desired == 1 and decision.direction == "none"
    assert "≈ target 4" in decision.reason


def test_just_outside_tolerance_band_scales():
    decision = decide_replicas([pod("a", 4.5, 0.5)], 1, SPEC, (), now=0)
    assert decision.desired == 2


def test_scale_down_waits_for_the_window_then_goes_to_the_highest_recommendation():
    busy = decide_replicas(pods(4, waiting=16, kv=0.5), 4, SPEC, (), now=0)
    assert busy.desired == 4
    # Load drops: the recommendation is 1, but 4 was recommended within the last 300 s.
    held = decide_replicas(pods(4, waiting=0, kv=0.1), 4, SPEC, busy.history, now=150)
    assert held.recommendation == 1 and held.desired == 4
    assert "scale-down held: highest recommendation in last 300s is 4" in held.reason
    # A medium load recommending 3 at t=200 is remembered as well.
    medium = decide_replicas(pods(4, waiting=10, kv=0.1), 4, SPEC, held.history, now=200)
    assert medium.recommendation == 3 and medium.desired == 4
    # After the busy poll left the window, only the highest remaining (3 at t=200) counts.
    later = decide_replicas(pods(4, waiting=0, kv=0.1), 4, SPEC, medium.history, now=301)
    assert later.desired == 3 and later.direction == "down"
    assert "4 → 3" in later.reason
    last = decide_replicas(pods(3, waiting=0, kv=0.1), 3, SPEC, later.history, now=501)
    assert last.desired == 1


def test_first_poll_never_scales_down():
    # Empty history = the operator just (re)started: it has not watched a window yet.
    first = decide_replicas(pods(3, 0, 0.0), 3, SPEC, (), now=1000)
    assert first.desired == 3
    assert "highest recommendation in last 300s is 3" in first.reason


def test_missing_pod_blocks_scale_down_with_reason():
    samples = [pod("a", 0, 0.05), pod("b", 0, 0.05), pod("c", scraped=False)]
    history = (Recommendation(0, 1),)
    decision = decide_replicas(samples, 3, SPEC, history, now=1000)
    assert decision.recommendation == 1 and decision.desired == 3
    assert "metrics missing from 1 of 3 pods: not scaling down" in decision.reason
    assert decision.pods_missing == 1 and decision.pods_reporting == 2


def test_unready_pod_is_not_idle_capacity():
    samples = [pod("a", 0, 0.05), pod("b", 0, 0.0, ready=False)]
    decision = decide_replicas(samples, 2, SPEC, (Recommendation(0, 1),), now=1000)
    assert decision.desired == 2 and decision.pods_missing == 1


def test_missing_data_does_not_shorten_a_later_scale_down_window():
    samples = [pod("a", 0, 0.05), pod("b", scraped=False)]
    blind = decide_replicas(samples, 2, SPEC, (Recommendation(0, 2),), now=400)
    assert blind.history[-1].replicas == 2  # recorded as "keep 2", not the blind guess of 1
    back = decide_replicas(pods(2, 0, 0.05), 2, SPEC, blind.history, now=500)
    assert back.desired == 2  # the window restarted when data went missing


def test_a_pod_missing_for_more_than_n_polls_stops_blocking_scale_down():
    # Two idle pods and one whose /metrics never answers (broken, or stuck not ready): held
    # for STALE_AFTER_POLLS polls, then ignored; the usual scale-down window still applies.
    stuck = [pod("a", 0, 0.05), pod("b", 0, 0.05), pod("c", scraped=False)]
    decisions = run_polls(lambda n: stuck, SPEC, 3, 60)
    window_polls = SPEC.scale_down_stabilization_seconds / SPEC.poll_interval_seconds
    changed = first_change(decisions)
    assert changed is not None, "one unreadable pod blocked scale-down forever"
    assert STALE_AFTER_POLLS <= changed <= STALE_AFTER_POLLS + window_polls + 1
    assert all("not scaling down" in d.reason for d in decisions[:STALE_AFTER_POLLS])
    down = decisions[changed]
    assert down.desired < 3 and down.pods_ignored == ("c",)
    assert "c: missing for more than 5 polls, ignored" in down.reason
    assert down.pods_missing == 1  # still reported as missing


def test_a_pod_that_answers_again_starts_its_count_afresh():
    answering = [pod("a", 0, 0.05), pod("b", 0, 0.05)]
    silent = [*answering, pod("c", scraped=False)]
    missing: dict = {}
    loads = [silent] * STALE_AFTER_POLLS + [[*answering, pod("c", 0, 0.05)]] + [silent]
    for i, samples in enumerate(loads):
        decision = decide_replicas(samples, 3, SPEC, (Recommendation(0, 1),), 1000 + i, missing)
        missing = decision.missing_polls
    assert decision.missing_polls == {"c": 1} and not decision.pods_ignored
    assert decision.desired == 3 and "not scaling down" in decision.reason


def test_pods_never_created_stop_blocking_after_n_polls():
    # Scaled to 3 but a ResourceQuota lets only one pod exist: the two that never appear hold
    # a scale-down for STALE_AFTER_POLLS polls, not forever.
    spec = autoscaling({"scaleDownStabilizationSeconds": 0})
    decisions = run_polls(lambda n: [pod("a", 0, 0.0)], spec, 3, STALE_AFTER_POLLS + 2)
    assert first_change(decisions) == STALE_AFTER_POLLS
    assert decisions[STALE_AFTER_POLLS].pods_ignored == (NOT_CREATED,)
    assert decisions[STALE_AFTER_POLLS].desired == 1


def test_scale_up_still_happens_on_the_pods_that_answered():
    samples = [pod("a", 20, 0.5), pod("b", scraped=False)]
    decision = decide_replicas(samples, 2, SPEC, (), now=0)
    assert decision.desired == 4
    assert "queue 20 waiting over 2 replicas > target 4 per replica" in decision.reason
    assert "metrics missing from 1 of 2 pods" in decision.reason


def test_pods_not_yet_listed_count_as_missing():
    # Scaled to 3 a moment ago; only one pod exists yet. It is idle, but that is no reason
    # to undo the scale-up.
    decision = decide_replicas([pod("a", 0, 0.0)], 3, SPEC, (Recommendation(0, 1),), now=1000)
    assert decision.desired == 3 and decision.pods_missing == 2


def test_no_metrics_at_all_holds():
    decision = decide_replicas([pod("a", scraped=False), pod("b", ready=False)], 2, SPEC, (), 0)
    assert decision.desired == 2
    assert decision.mean_kv_usage is None
    assert "metrics missing from all 2 pods" in decision.reason


def test_zero_replicas_comes_back_to_min_replicas():
    spec = autoscaling({"minReplicas": 2})
    decision = decide_replicas([], 0, spec, (), now=0)
    assert decision.desired == 2
    assert "below minReplicas 2" in decision.reason


def test_replicas_above_a_lowered_max_come_down_at_once():
    decision = decide_replicas(pods(6, waiting=40, kv=0.9), 6, SPEC, (), now=0)
    assert decision.desired == 4
    assert "above maxReplicas 4" in decision.reason


def test_scale_up_stabilization_waits_for_a_sustained_recommendation():
    spec = autoscaling({"scaleUpStabilizationSeconds": 30, "maxReplicas": 8})
    decisions = run_polls(lambda n: pods(n, waiting=12, kv=0.5), spec, 1, 4, interval=15)
    # t=0: just started; t=15: the start (1) still in the window; t=30: 1 has left the window.
    assert [d.desired for d in decisions[:3]] == [1, 1, 2]
    assert "scale-up held: lowest recommendation in last 30s is 1" in decisions[1].reason


def test_history_is_trimmed_to_the_longest_window():
    decisions = run_polls(lambda n: pods(n, waiting=4 * n, kv=0.5), SPEC, 1, 100)
    oldest = decisions[-1].history[0].at
    assert 99 * 15 - oldest <= 300
    assert len(decisions[-1].history) <= 300 / 15 + 1


# --- properties -----------------------------------------------------------------------------

specs = st.builds(
    lambda lo, extra, queue, kv, up, down: dataclasses.replace(
        SPEC,
        min_replicas=lo,
        max_replicas=lo + extra,
        target_queue_depth=queue,
        target_kv_cache_usage=kv,
        scale_up_stabilization_seconds=up,
        scale_down_stabilization_seconds=down,
        poll_interval_seconds=15,
    ),
    st.integers(1, 4),
    st.integers(0, 12),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.floats(0.3, 1.0),
    st.sampled_from([0, 15, 30, 60]),
    st.sampled_from([0, 15, 60, 150]),
)
samples_lists = st.lists(
    st.builds(
        PodSample,
        pod=st.just("p"),
        ready=st.booleans(),
        scraped=st.booleans(),
        waiting=st.floats(0, 200),
        running=st.just(0.0),
        kv_usage=st.floats(0, 1),
    ),
    max_size=12,
)
histories = st.lists(
    st.builds(Recommendation, at=st.floats(0, 1000), replicas=st.integers(1, 20)), max_size=8
).map(lambda rs: tuple(sorted(rs, key=lambda r: r.at)))
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(samples_lists, st.integers(0, 20), specs, histories)
def test_desired_is_always_within_bounds(samples, current, spec, history):
    decision = decide_replicas(samples, current, spec, history, now=1000)
    assert spec.min_replicas <= decision.desired <= spec.max_replicas


@FAST
@given(samples_lists, st.integers(1, 20), specs, histories)
def test_never_scales_down_while_any_data_is_missing(samples, current, spec, history):
    decision = decide_replicas(samples, current, spec, history, now=1000)
    in_bounds = spec.min_replicas <= current <= spec.max_replicas
    if in_bounds and (len(samples) < current or not all(s.reporting for s in samples)):
        assert decision.desired >= current, decision.reason


@FAST
@given(samples_lists, st.integers(1, 20), specs, histories)
def test_never_more_than_doubles(samples, current, spec, history):
    decision = decide_replicas(samples, current, spec, history, now=1000)
    if current >= spec.min_replicas:
        assert decision.desired <= 2 * current


@FAST
@given(samples_lists, st.integers(1, 20), specs, histories)
def test_scale_down_never_goes_below_the_window_highest(samples, current, spec, history):
    decision = decide_replicas(samples, current, spec, history, now=1000)
    if decision.direction == "down" and current <= spec.max_replicas:
        window = [
            r.replicas for r in history if r.at > 1000 - spec.scale_down_stabilization_seconds
        ]
        assert decision.desired >= max([*window, decision.recommendation])


@FAST
@given(samples_lists, st.integers(1, 20), specs, histories)
def test_reason_names_the_numbers(samples, current, spec, history):
    decision = decide_replicas(samples, current, spec, history, now=1000)
    assert decision.reason
    if decision.direction != "none":
        assert f"{current} → {decision.desired}" in decision.reason
    if decision.pods_reporting and spec.min_replicas <= current <= spec.max_replicas:
        queue = f"queue {decision.total_waiting:g} waiting over {current} replica"
        kv = f"KV cache {decision.mean_kv_usage * 100:.0f}%"
        # A (possibly held) scale-up names the signals that drive it; anything else names both.
        if decision.recommendation > current:
            assert queue in decision.reason or kv in decision.reason
        else:
            assert queue in decision.reason and kv in decision.reason


@FAST
@given(
    specs,
    st.floats(0, 100),  # total requests waiting across the service, shared evenly
    st.floats(0, 6),  # total KV demand, in "full caches"; each pod reports min(1, demand / n)
    st.integers(1, 16),
)
def test_steady_load_converges_without_flapping(spec, waiting, kv_demand, start):
    def load(n: int) -> list[PodSample]:
        return pods(n, waiting=waiting, kv=min(1.0, kv_demand / n))

    # Room for every step up (each waits out the up window; ≤ 6 steps to reach 16), the down
    # window, then ten quiet polls.
    up_polls = math.ceil(spec.scale_up_stabilization_seconds / 15) + 1
    polls = 6 * up_polls + math.ceil(spec.scale_down_stabilization_seconds / 15) + 20
    replicas = [start] + [d.desired for d in run_polls(load, spec, start, polls)]
    steps = [b - a for a, b in itertools.pairwise(replicas) if b != a]
    # Monotone: once it moved one way it never moves back while the load stays the same...
    assert all(s > 0 for s in steps) or all(s < 0 for s in steps), replicas
    # ...and it settles: the last ten polls change nothing.
    assert len(set(replicas[-10:])) == 1, replicas


def test_worked_example_from_the_docs():
    # docs/autoscaling.md, "Worked example": (t, waiting, KV usage) → replicas after the poll.
    polls = [(0, 2, 0.4, 1), (15, 14, 0.95, 2), (30, 14, 0.9, 4), (45, 3, 0.5, 4)]
    polls += [(t, 0, 0.2, 4) for t in range(60, 330, 15)]
    polls += [(330, 0, 0.2, 3), (345, 0, 0.2, 1), (360, 0, 0.2, 1)]
    current, history = 1, ()
    for t, waiting, kv, expected in polls:
        decision = decide_replicas(pods(current, waiting, kv), current, SPEC, history, now=t)
        assert decision.desired == expected, (t, decision.reason)
        current, history = decision.desired, decision.history


def test_the_docs_state_the_missing_pod_bound_the_code_uses():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "autoscaling.md").read_text()
    assert f"more than **{STALE_AFTER_POLLS} polls in a row**" in docs

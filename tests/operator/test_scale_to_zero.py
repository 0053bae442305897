"""Scale to zero, the decision half: the idle clock (idle.py) and decide_replicas' rule 2b.
What a platform engineer would check: a service with minReplicas 0 goes to 0 only after
scaleToZeroAfterSeconds with no request at all, never while anything runs or waits, and the
replica the router's activator started is not taken away under its first request."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfleet.operator.autoscaler import PodSample, decide_replicas
from kvfleet.operator.idle import IdleClock, observe
from kvfleet.operator.spec import AutoscalingSpec, parse_autoscaling

SPEC = parse_autoscaling(
    {
        "enabled": True,
        "minReplicas": 0,
        "maxReplicas": 3,
        "pollIntervalSeconds": 10,
        "scaleToZeroAfterSeconds": 60,
    }
).check()


def idle_pod(name: str = "p0", finished: float = 0) -> PodSample:
    return PodSample(name, ready=True, scraped=True, finished=finished)


def run(samples_at, start: int, polls: int, spec: AutoscalingSpec = SPEC, interval: float = 10):
    """Poll like the autoscaler's loop: the idle clock, then the decision, fed their outputs.
    `samples_at(i, replicas)` gives poll i's samples. Returns [(time, current, desired, reason)]."""
    current, history, missing, clock, out = start, (), {}, None, []
    for i in range(polls):
        now = i * interval
        samples = samples_at(i, current)
        clock = observe(clock, samples, current, now)
        decision = decide_replicas(
            samples, current, spec, history, now, missing, idle_for=clock.idle_for(now)
        )
        out.append((now, current, decision.desired, decision.reason))
        current, history, missing = decision.desired, decision.history, decision.missing_polls
    return out


def first_zero(polls) -> float | None:
    return next((t for t, cur, desired, _ in polls if cur > 0 and desired == 0), None)


def test_an_idle_service_goes_to_zero_after_the_timeout_and_not_before():
    polls = run(lambda i, n: [idle_pod(f"p{k}") for k in range(n)], start=1, polls=12)
    assert first_zero(polls) == 60
    assert all(desired == 1 for t, _, desired, _ in polls if t < 60)
    assert "no requests for 60s (scaleToZeroAfterSeconds 60): scaling 1 → 0" in polls[6][3]
    # At 0 it stays at 0, and says who brings it back.
    assert polls[7][1:3] == (0, 0)
    assert "router's activator starts a replica on the next request" in polls[7][3]


def test_load_signals_alone_never_ask_for_zero():
    # No idle clock (None): an idle pod with minReplicas 0 stays at 1 however long.
    history, current = (), 2
    for i in range(40):
        samples = [idle_pod("a"), idle_pod("b")][:current]
        d = decide_replicas(samples, current, SPEC, history, i * 10.0, idle_for=None)
        current, history = d.desired, d.history
    assert current == 1


def test_a_request_finishing_between_polls_restarts_the_timer():
    # Nothing is ever running at a poll, but a request finishes at 40 s.
    polls = run(lambda i, n: [idle_pod(finished=1 if i >= 4 else 0)] * n, start=1, polls=16)
    assert first_zero(polls) == 40 + 60


def test_never_to_zero_while_a_request_runs_or_waits():
    busy = PodSample("p0", ready=True, scraped=True, running=1)
    polls = run(lambda i, n: [busy] * n, start=1, polls=30)
    assert first_zero(polls) is None


def test_a_pod_without_metrics_is_not_idle():
    unread = PodSample("p0", ready=True, scraped=False, error="timeout")
    polls = run(lambda i, n: [unread] * n, start=1, polls=30)
    assert first_zero(polls) is None


def test_the_activators_replica_gets_a_whole_idle_period():
    # At 0 until 100 s, when the activator scales to 1 for a request that finishes before the
    # next poll sees anything running: the idle period counts from the scale-up.
    def samples(i, n):
        return [idle_pod(finished=1)] * n

    current, history, clock = 0, (), IdleClock(0.0, "test", 0, {})
    timeline = []
    for i in range(25):
        now = i * 10.0
        if now == 100:
            current = 1  # the activator's scale-up, between two polls
        s = samples(i, current)
        clock = observe(clock, s, current, now)
        d = decide_replicas(s, current, SPEC, history, now, idle_for=clock.idle_for(now))
        timeline.append((now, current, d.desired))
        current, history = d.desired, d.history
    zero_at = next(t for t, cur, desired in timeline if cur == 1 and desired == 0)
    assert zero_at == 100 + 60


def test_a_restarted_autoscaler_watches_a_whole_idle_period():
    clock = observe(None, [idle_pod(finished=7)], 1, now=500)
    assert clock.idle_for(500) == 0 and clock.activity == "the autoscaler started"
    clock = observe(clock, [idle_pod(finished=7)], 1, now=530)
    assert clock.idle_for(530) == 30  # no change since the restart: idle, from the restart


def test_the_clock_says_what_it_saw():
    clock = observe(None, [], 1, 0)
    clock = observe(clock, [PodSample("p0", True, True, waiting=2)], 1, 10)
    assert clock.activity == "0 requests running, 2 waiting"
    clock = observe(clock, [idle_pod("p0", finished=3)], 1, 20)
    assert clock.activity == "requests finished on p0" and clock.last_activity == 20
    clock = observe(clock, [idle_pod("p0", finished=3)], 2, 30)
    assert clock.activity == "1 pods not created yet"


def test_min_replicas_above_zero_never_goes_to_zero():
    spec = parse_autoscaling({"enabled": True, "minReplicas": 1}).check()
    d = decide_replicas([idle_pod()], 1, spec, (), 0, idle_for=10_000)
    assert d.desired == 1


samples_lists = st.lists(
    st.builds(
        PodSample,
        pod=st.sampled_from(["a", "b", "c"]),
        ready=st.booleans(),
        scraped=st.booleans(),
        waiting=st.sampled_from([0.0, 0.0, 1.0, 5.0]),
        running=st.sampled_from([0.0, 0.0, 1.0]),
        kv_usage=st.floats(0, 1),
        finished=st.sampled_from([0.0, 1.0, 9.0]),
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples_lists, st.integers(1, 4), st.floats(0, 10_000))
def test_zero_only_when_everything_reads_idle(samples, current, idle_for):
    d = decide_replicas(samples, current, SPEC, (), 0, idle_for=idle_for)
    if d.desired == 0:
        assert idle_for >= SPEC.scale_to_zero_after_seconds
        assert len(samples) >= current and all(s.reporting for s in samples)
        assert all(s.running == 0 and s.waiting == 0 for s in samples)
    else:
        assert d.desired >= 1

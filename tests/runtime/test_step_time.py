"""Streams keep flowing while long prompts arrive: the scheduler gives prompts only the share of
a step that keeps it within --max-step-time-ratio of the running requests' decode-only step,
by step times it learns as it goes (step_time.py). Driven without a model, on simulated hosts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfleet.runtime.engine.config import ConfigError, EngineConfig
from kvfleet.runtime.engine.scheduler import SchedulerConfig
from kvfleet.runtime.engine.step_time import (
    MIN_STALL_S,
    PACE_DECAY,
    PACE_HEADROOM,
    StepTimeModel,
    context_sum,
)
from test_scheduler_fairness import Run

# The engine's warm-up as (prompt tokens, decode rows) per step: a prefill, decodes of 7 rows
# down to 1, then prefills of three other sizes, each with its decodes.
WARM_UP = [
    (576, 0),
    *((0, n) for n in range(7, 0, -1)),
    *((128, 0), (0, 2), (24, 0), (0, 1), (256, 0), (0, 1)),
]


@dataclass(frozen=True)
class Host:
    """A simulated host: a decode-only step of n rows takes fixed + per_row * n; prompt tokens
    add switch + per_token * p + per_context * c to it (the op-by-op path's extra cost, then
    each token's, then attention's for the c tokens of context they attend to in all)."""

    fixed: float
    per_row: float
    switch: float
    per_token: float
    per_context: float = 0.0

    def decode_only(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    def step(self, prompt: int, rows: int, context: int = 0) -> float:
        added = self.switch + self.per_token * prompt + self.per_context * context
        return self.decode_only(rows) + (added if prompt else 0)


def fed(host: Host, steps: list[tuple[int, ...]]) -> StepTimeModel:
    """A model fed steps of (prompt tokens, decode rows[, where the prompt chunk starts])."""
    model = StepTimeModel()
    for prompt, rows, *start in steps:
        context = context_sum(start[0] if start else 0, prompt) if prompt else 0
        model.observe(prompt, rows, host.step(prompt, rows, context), context)
    return model


hosts = st.builds(
    Host,
    fixed=st.floats(1e-4, 0.5),
    per_row=st.floats(0.0, 1e-2),
    switch=st.floats(0.0, 0.02),
    per_token=st.floats(1e-6, 1e-2),
    per_context=st.one_of(st.just(0.0), st.floats(1e-9, 1e-5)),
)
# A 2-core CPU's bundled model, roughly; and a tiny model whose decode steps are one C call.
CPU_BUNDLED = Host(fixed=0.010, per_row=0.0006, switch=0.002, per_token=0.0006, per_context=4e-7)
TINY = Host(fixed=0.002, per_row=0.0002, switch=0.003, per_token=0.00003)


steps = st.tuples(st.integers(0, 4096), st.integers(0, 256), st.integers(0, 8192))


@given(host=hosts, extra=st.lists(steps))
def test_the_fit_recovers_a_hosts_costs(host: Host, extra: list[tuple[int, int, int]]):
    model = fed(host, WARM_UP + extra)
    for rows in (1, 8, 100):
        assert model.decode_only(rows) == pytest.approx(host.decode_only(rows), rel=1e-6)
    cost = model.prompt_cost()
    assert cost is not None

    def added(tokens: int, start: int) -> float:
        return host.step(tokens, 0, context_sum(start, tokens)) - host.decode_only(0)

    # Least squares from sums of squares keeps about five digits of the longest step fed: a term
    # below that is left out, and what that moves in the others grows where the fit extrapolates,
    # to 2048 tokens 4000 in.
    longest = max(added(p, (start or [0])[0]) for p, _, *start in WARM_UP + extra if p)
    for tokens, start in itertools.product((1, 16, 64, 256, 2048), (0, 1000, 4000)):
        predicted = cost.fixed + cost.seconds(tokens, start)
        assert predicted == pytest.approx(added(tokens, start), rel=1e-3, abs=1e-5 * longest)


def allowance(model: StepTimeModel, decodes: int, ratio: float, start: int = 0) -> int | None:
    """The prompt tokens from position `start` a step beside `decodes` decodes may carry."""
    seconds, cost = model.prompt_seconds(decodes, ratio), model.prompt_cost()
    return None if seconds is None or cost is None else cost.tokens_within(seconds, start)


@given(
    host=hosts, decodes=st.integers(1, 512), ratio=st.floats(1.1, 10.0), start=st.integers(0, 8192)
)
def test_the_allowance_keeps_a_step_within_the_ratio(
    host: Host, decodes: int, ratio: float, start: int
) -> None:
    """Wherever in its prompt the chunk starts: late chunks attend to more context."""
    tokens = allowance(fed(host, WARM_UP), decodes, ratio, start)
    assert tokens is not None and tokens >= 0
    decode_only = host.decode_only(decodes)
    bound = max(ratio * decode_only, decode_only + MIN_STALL_S)
    if tokens:
        assert host.step(tokens, decodes, context_sum(start, tokens)) <= bound * (1 + 1e-6)
    # ... and it is the most that fits: one token more would not.
    assert host.step(tokens + 1, decodes, context_sum(start, tokens + 1)) > bound * (1 - 1e-6)


def test_no_allowance_without_a_basis():
    assert StepTimeModel().prompt_seconds(8, 2.5) is None  # nothing seen
    assert fed(CPU_BUNDLED, [(0, 8)] * 5).prompt_seconds(8, 2.5) is None  # no prompt seen
    model = fed(CPU_BUNDLED, WARM_UP)
    assert model.prompt_seconds(0, 2.5) is None  # nobody decoding: nobody to stall
    assert model.prompt_seconds(8, 1.0) is None


def test_the_fit_follows_a_host_that_slows_down():
    model = fed(CPU_BUNDLED, WARM_UP * 30)
    slow = Host(*(2 * c for c in (0.010, 0.0006, 0.002, 0.0006)))
    for _ in range(100):
        for prompt, rows in WARM_UP:
            model.observe(prompt, rows, slow.step(prompt, rows))
    assert model.prompt_cost().per_token == pytest.approx(2 * 0.0006, rel=0.05)  # type: ignore[union-attr]
    assert model.decode_only(8) == pytest.approx(slow.decode_only(8), rel=0.05)


def test_one_stalled_step_barely_moves_the_allowance():
    """A step the host stalled (another process took the cores) is one step, not the host."""
    model = fed(CPU_BUNDLED, WARM_UP * 4)  # enough steps for the fit to have settled
    before = allowance(model, 8, 2.5)
    model.observe(64, 8, 100 * CPU_BUNDLED.step(64, 8), context_sum(0, 64))
    model.observe(0, 8, 100 * CPU_BUNDLED.decode_only(8))
    after = allowance(model, 8, 2.5)
    assert before is not None and after is not None
    assert after == pytest.approx(before, rel=0.3)  # untempered, it would fall 100-fold


class TimedRun(Run):
    """A scheduler run on a simulated host; records each step's time. The scheduler learns the
    host from the engine's warm-up steps, as it does in the engine."""

    def __init__(self, config: SchedulerConfig, host: Host):
        super().__init__(config)
        self.host = host
        self.times: list[float] = []
        self.model = self.sched.step_times  # None where the scheduler bounds nothing
        for prompt, rows in WARM_UP:
            if self.model is not None:
                context = context_sum(0, prompt)
                self.model.observe(prompt, rows, host.step(prompt, rows, context), context)

    def step(self):  # type: ignore[override]
        batch = super().step()
        rows = batch.num_tokens.count(1)
        context = sum(
            context_sum(r.num_computed_tokens - n, n)
            for r, n in zip(batch.requests, batch.num_tokens, strict=True)
            if n > 1
        )
        seconds = self.host.step(batch.total_tokens - rows, rows, context)
        if self.model is not None:
            self.model.observe(batch.total_tokens - rows, rows, seconds, context)
        self.times.append(seconds)
        return batch


def stream_gaps(run: TimedRun, rid: str, since: int) -> list[float]:
    """The simulated time between one request's consecutive tokens, from step `since` on."""
    steps = [i for i, ready in enumerate(run.decode_ready) if rid in ready and i >= since]
    return [sum(run.times[a + 1 : b + 1]) for a, b in itertools.pairwise(steps)]


@pytest.mark.parametrize("ratio", [2.5, 0.0])
def test_a_long_prompt_never_stalls_running_streams_beyond_the_ratio(ratio: float):
    """8 streams decode; a 4096-token prompt arrives. With the ratio, every stream's gaps stay
    within it of a decode-only step, or what keeps prefill ahead of the arrival where that is
    more; without it, one step carries 2040 prompt tokens."""
    run = TimedRun(SchedulerConfig(64, 2048, True, 0, ratio), CPU_BUNDLED)
    streams = [run.add(f"r{i}", 32 + i, 400) for i in range(8)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in streams):
        run.step()
    for _ in range(3):
        run.step()
    arrived = run.step_no
    run.add("r99", 4096, 4)
    for _ in range(200):
        run.step()
    decode_only = CPU_BUNDLED.decode_only(8)
    worst = max(max(stream_gaps(run, r.request_id, arrived)) for r in streams)
    # The most the arrivals' pace ever allows: every prompt here counted as if it just arrived.
    prompts = [4096] + [r.num_prompt_tokens for r in streams]
    pace = (
        PACE_HEADROOM
        * (1 - PACE_DECAY)
        * sum(
            CPU_BUNDLED.per_token * p + CPU_BUNDLED.per_context * context_sum(0, p) for p in prompts
        )
    )
    if ratio:
        bound = max(ratio * decode_only, decode_only + MIN_STALL_S, CPU_BUNDLED.step(1, 8) + pace)
        assert worst <= bound * 1.01
    else:
        assert worst > 50 * decode_only  # what the bound is for: a whole chunk in one step
    assert run.first_token.get("r99") is not None  # and the long prompt got through


def test_prompts_take_the_whole_budget_when_nobody_decodes():
    run = TimedRun(SchedulerConfig(64, 2048, True, 0, 2.5), CPU_BUNDLED)
    run.add("r0", 4096, 4)
    assert run.step().total_tokens == 2048


def test_a_burst_of_arrivals_is_not_held_to_the_few_streams_pace():
    """100 prompts arrive while 4 streams decode: the waiting outnumber the decoding, so the
    step admits them at the pace of their number (here: the whole budget), not at the 4
    streams' allowance."""
    run = TimedRun(SchedulerConfig(256, 2048, True, 0, 2.5), TINY)
    for i in range(4):
        run.add(f"r{i}", 16, 500)
    for _ in range(3):
        run.step()
    plain = allowance(run.sched.step_times, 4, 2.5)
    for i in range(4, 104):
        run.add(f"r{i}", 256, 4)
    batch = run.step()
    assert plain is not None and batch.total_tokens - 4 > min(10 * plain, 2048 - 4 - 16)


def test_the_ratio_is_checked_where_it_enters():
    assert EngineConfig(max_step_time_ratio=0).max_step_time_ratio == 0
    for bad in (1.0, 0.5, -1.0, 101.0):
        with pytest.raises(ConfigError, match="max_step_time_ratio"):
            EngineConfig(max_step_time_ratio=bad)

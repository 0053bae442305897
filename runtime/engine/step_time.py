"""How long a step takes, learned from the steps the engine runs, and how many prompt tokens a
step may carry while other requests decode.

Two lines are fitted as the engine runs: what a decode-only step of n rows takes (a fixed
part — on CPU streaming the weights, on a GPU launching kernels — plus a cost per row), and
what p prompt tokens add to a step on top of its decodes (that step's time less the decode-only
time of its rows: a fixed part, the cost of leaving the decode-only path, plus a cost per
prompt token). They are kept apart because the two kinds of step run different paths — a CPU's
decode-only step is one fused C call, a mixed step runs op by op — so one line through all
steps would misjudge both. Older steps weigh less, so the figures follow a host whose speed
drifts.

The scheduler asks for a prompt allowance: while requests are decoding, a step may take at most
`ratio` times what their decode-only step would, so a long prompt arriving never stalls the
streams for a whole prefill — it is spread over several steps, each adding a bounded delay to
every stream's next token. What a fixed token budget cannot do: the allowance on a 2-core CPU
is tens of tokens a step, on an H100 thousands, for the same ratio. The allowance is never
below what keeps prefill ahead of the prompt tokens arriving (PromptPace): where the ratio
allows less than arrives, prompts would pile up and the streams the ratio protects would thin
out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Older steps fade with this factor per step: the figures follow roughly the last 100 steps.
DECAY = 0.99
# A step's time counts as at most this factor away from what the fit expects of it, once the
# fit rests on this many steps' weight (before that it is still finding its shape).
OUTLIER = 2.0
SETTLED = 8.0
# A stall this short is not felt by anyone reading a stream (it is half a token at a brisk
# reader's pace), so prompts may always add this much to a step: where decode steps take a few
# milliseconds (a small model), a ratio alone would starve prompts of tokens for nothing.
MIN_STALL_S = 0.025


@dataclass(slots=True)
class WeightedLine:
    """y = intercept + slope * x by weighted least squares, older points fading by `decay`."""

    decay: float = DECAY
    _w: float = 0.0
    _x: float = 0.0
    _xx: float = 0.0
    _y: float = 0.0
    _xy: float = 0.0

    @property
    def weight(self) -> float:
        """How many points the fit rests on, older ones counting less."""
        return self._w

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y

    def fit(self, min_spread: float, through_origin: bool) -> tuple[float, float] | None:
        """(intercept, slope), both >= 0, or None before any point. Points of (nearly) one x —
        a spread below `min_spread` — cannot tell a slope: they give a flat line at their mean,
        or with `through_origin` the line from the origin through their mean."""
        w = self._w
        if w <= 0:
            return None
        mean_x, mean_y = self._x / w, self._y / w
        variance = self._xx / w - mean_x * mean_x
        if variance >= min_spread * min_spread:
            slope = max((self._xy / w - mean_x * mean_y) / variance, 0.0)
            return max(mean_y - slope * mean_x, 0.0), slope
        if through_origin and mean_x > 0:
            return 0.0, max(mean_y / mean_x, 0.0)
        return mean_y, 0.0


@dataclass(slots=True)
class StepTimeModel:
    """Decode-only step time as a line in its rows; what prompt tokens add to a step, as a line
    in their number."""

    decode: WeightedLine = field(default_factory=WeightedLine)
    prompt: WeightedLine = field(default_factory=WeightedLine)

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """Record a step that computed `prompt_tokens` prompt tokens beside `decode_rows`
        decodes in `seconds`."""
        if not math.isfinite(seconds) or seconds <= 0 or prompt_tokens + decode_rows <= 0:
            return
        base = self.decode_only(decode_rows)
        if prompt_tokens == 0:
            settled = self.decode.weight >= SETTLED
            self.decode.add(decode_rows, _tempered(seconds, base) if settled else seconds)
            return
        if base is None:
            return
        added = max(seconds - base, 0.0)
        cost = self.prompt_cost()
        if cost is not None and self.prompt.weight >= SETTLED:
            added = _tempered(added, cost[0] + cost[1] * prompt_tokens)
        self.prompt.add(prompt_tokens, added)

    def decode_only(self, rows: int) -> float | None:
        """The time a decode-only step of `rows` rows takes, or None before any was seen."""
        fitted = self.decode.fit(min_spread=0.5, through_origin=False)
        return None if fitted is None else fitted[0] + fitted[1] * rows

    def prompt_cost(self) -> tuple[float, float] | None:
        """(seconds any prompt tokens add to a step, seconds per prompt token), or None before
        a step with prompt tokens was seen."""
        fitted = self.prompt.fit(min_spread=8.0, through_origin=True)
        return None if fitted is None or fitted[1] <= 0 else fitted

    def prompt_allowance(self, decode_rows: int, ratio: float) -> int | None:
        """The most prompt tokens a step with `decode_rows` decodes may add so that it takes at
        most `ratio` times their decode-only step, or MIN_STALL_S longer where that is more (0
        where even one token would not fit); None when there is no bound to give (nothing
        measured yet, no decodes, or ratio <= 1)."""
        if decode_rows <= 0 or ratio <= 1.0:
            return None
        decode_only, cost = self.decode_only(decode_rows), self.prompt_cost()
        if decode_only is None or cost is None:
            return None
        fixed, per_token = cost
        stall = max((ratio - 1.0) * decode_only, MIN_STALL_S)
        return max(int((stall - fixed) / per_token), 0)


# Prompts get at least this many times the prompt tokens arriving per step, so prefill keeps
# ahead of arrivals whatever the step-time bound allows: a bound below the arrival rate would
# leave requests queueing for their prompt while fewer and fewer streams decode.
PACE_HEADROOM = 1.2


@dataclass(slots=True)
class PromptPace:
    """Prompt tokens arriving per step (new requests and preempted ones' recompute), averaged
    over roughly the last 100 steps; one arrival's tokens count for the steps after it."""

    rate: float = 0.0
    _arrived: int = 0

    def arrive(self, tokens: int) -> None:
        self._arrived += tokens

    def step(self) -> int:
        """Fold in what arrived since the last step; the prompt tokens a step must be allowed
        to carry for prefill to keep ahead of arrivals."""
        self.rate = self.rate * DECAY + self._arrived * (1.0 - DECAY)
        self._arrived = 0
        return math.ceil(PACE_HEADROOM * self.rate)


def _tempered(seconds: float, expected: float | None) -> float:
    """A step's time, held within a factor of OUTLIER of what the fit expects: one step that
    the host stalled (another process, a page fault storm) moves the fit a little, not by the
    stall."""
    if expected is None or expected <= 0:
        return seconds
    return min(max(seconds, expected / OUTLIER), expected * OUTLIER)

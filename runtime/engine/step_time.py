"""How long a step takes, learned from the steps the engine runs, and how many prompt tokens a
step may carry while other requests decode.

Two fits are kept as the engine runs: what a decode-only step of n rows takes (a fixed part —
on CPU streaming the weights, on a GPU launching kernels — plus a cost per row), and what prompt
chunks add to a step on top of its decodes (that step's time less the decode-only time of its
rows): a fixed part, the cost of leaving the decode-only path; a cost per prompt token, the
weights' work; and a cost per token of context those tokens attend to, attention's work — a
chunk late in a long prompt costs more per token the further in it is, so a fit in tokens
alone lets late chunks overrun the step. The two fits are kept apart because
the two kinds of step run different paths — a CPU's decode-only step is one fused C call, a
mixed step runs op by op — so one fit through all steps would misjudge both. Older steps weigh
less, so the figures follow a host whose speed drifts.

The scheduler asks for the prompts' time in a step: while requests are decoding, a step may take
at most `ratio` times what their decode-only step would, so a long prompt arriving never stalls
the streams for a whole prefill — it is spread over several steps, each adding a bounded delay
to every stream's next token. It converts that time to tokens per prompt where each prompt's
chunk starts (PromptCost.tokens_within). What a fixed token budget cannot do: that time buys
tens of tokens a step on a 2-core CPU, thousands on an H100, fewer late in a long prompt than
early. The time is never below what keeps prefill ahead of the prompt work arriving
(PromptPace): where the ratio allows less than arrives, prompts would pile up and the streams
the ratio protects would thin out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations

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


def context_sum(start: int, tokens: int) -> int:
    """The context the `tokens` tokens of a chunk starting at position `start` attend to, summed
    over them (each attends to the positions before it and itself): attention's work."""
    return tokens * start + tokens * (tokens + 1) // 2


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

    def fit(self, min_spread: float) -> tuple[float, float] | None:
        """(intercept, slope), both >= 0, or None before any point. Points of (nearly) one x —
        a spread below `min_spread` — cannot tell a slope: they give a flat line at their mean."""
        w = self._w
        if w <= 0:
            return None
        mean_x, mean_y = self._x / w, self._y / w
        variance = self._xx / w - mean_x * mean_x
        if variance >= min_spread * min_spread:
            slope = max((self._xy / w - mean_x * mean_y) / variance, 0.0)
            return max(mean_y - slope * mean_x, 0.0), slope
        return mean_y, 0.0


# A term counts only where the points vary in it beyond what the other terms explain, by this
# share of its (weighted) square: below it, its coefficient would be fitted to rounding and noise.
_MIN_PIVOT = 1e-6


@dataclass(slots=True)
class WeightedFit:
    """y = c0 + c1 * x1 + c2 * x2 with every c >= 0, by weighted least squares, older points
    fading by `decay`. The coefficients are the best of the fits on each subset of the terms
    whose coefficients all come out >= 0 (seven small systems): exact non-negative least squares
    for three terms, and a term that the points cannot tell apart from the others (one x, or x2
    fixed by x1) is left out rather than fitted to rounding."""

    decay: float = DECAY
    _m: list[float] = field(default_factory=lambda: [0.0] * 9)  # sum of u u^T, u = (1, x1, x2)
    _v: list[float] = field(default_factory=lambda: [0.0] * 3)  # sum of y u
    _fitted: tuple[float, float, float] | None = None  # read every step, changed once a step

    @property
    def weight(self) -> float:
        return self._m[0]

    def add(self, x1: float, x2: float, y: float) -> None:
        d, u = self.decay, (1.0, x1, x2)
        self._fitted = None
        for i in range(3):
            self._v[i] = self._v[i] * d + y * u[i]
            for j in range(3):
                self._m[3 * i + j] = self._m[3 * i + j] * d + u[i] * u[j]

    def fit(self) -> tuple[float, float, float] | None:
        """(c0, c1, c2), or None before any point."""
        if self.weight <= 0:
            return None
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float, float]:
        best, best_score = (0.0, 0.0, 0.0), 0.0
        # Fewer terms first, the per-token term first among equals: points of one x are told
        # by that term alone (a line through the origin) before an intercept.
        for size in (1, 2, 3):
            for terms in combinations((1, 0, 2), size):
                coef = self._solve(terms)
                if coef is None or min(coef) < 0:
                    continue
                # The sum of squares it explains: for a least squares solution, c . v.
                score = sum(c * self._v[t] for c, t in zip(coef, terms, strict=True))
                if score > best_score * (1 + 1e-12):  # beyond rounding: a term must add
                    full = [0.0, 0.0, 0.0]
                    for c, t in zip(coef, terms, strict=True):
                        full[t] = c
                    best, best_score = (full[0], full[1], full[2]), score
        return best

    def _solve(self, terms: tuple[int, ...]) -> list[float] | None:
        """The least squares coefficients on `terms` alone (Gaussian elimination on the normal
        equations, each term scaled to a unit diagonal), None where they are singular."""
        n = len(terms)
        scale = [math.sqrt(self._m[4 * t]) for t in terms]
        if min(scale) <= 0:
            return None
        a = [
            [self._m[3 * terms[i] + terms[j]] / (scale[i] * scale[j]) for j in range(n)]
            + [self._v[terms[i]] / scale[i]]
            for i in range(n)
        ]
        for k in range(n):
            pivot = max(range(k, n), key=lambda r: abs(a[r][k]))
            a[k], a[pivot] = a[pivot], a[k]
            if abs(a[k][k]) <= _MIN_PIVOT:
                return None
            for r in range(k + 1, n):
                f = a[r][k] / a[k][k]
                for c in range(k, n + 1):
                    a[r][c] -= f * a[k][c]
        x = [0.0] * n
        for k in range(n - 1, -1, -1):
            x[k] = (a[k][n] - sum(a[k][c] * x[c] for c in range(k + 1, n))) / a[k][k]
        return [x[i] / scale[i] for i in range(n)]


@dataclass(frozen=True, slots=True)
class PromptCost:
    """What prompt chunks add to a step: `fixed` once for any, `per_token` for each token and
    `per_context` for each token of context each of them attends to."""

    fixed: float
    per_token: float
    per_context: float

    def seconds(self, tokens: int, start: int) -> float:
        """A chunk of `tokens` prompt tokens from position `start`, less the fixed part."""
        return self.per_token * tokens + self.per_context * context_sum(start, tokens)

    def tokens_within(self, seconds: float, start: int) -> int:
        """The most tokens a chunk from position `start` may carry within `seconds`."""
        if seconds <= 0:
            return 0
        # per_context / 2 * n^2 + (per_token + per_context * (start + 1/2)) * n <= seconds
        a, b = self.per_context / 2, self.per_token + self.per_context * (start + 0.5)
        n = seconds / b if a <= 0 else (math.sqrt(b * b + 4 * a * seconds) - b) / (2 * a)
        n = int(min(n, 1 << 30))
        while n > 0 and self.seconds(n, start) > seconds:  # rounding
            n -= 1
        return n


@dataclass(slots=True)
class PromptTime:
    """The prompts' time in one step under the bound: `left` seconds beyond the fixed part,
    at most `share` of them to one prompt, bought at `cost`; the step's first prompt chunk
    gets `floor` tokens even where the time buys fewer, so prompts always progress."""

    cost: PromptCost
    left: float
    share: float
    floor: int

    def tokens(self, start: int, most: int) -> int:
        """How many of at most `most` prompt tokens from position `start` the time left buys
        (a chunk late in a long prompt, attending to more context, gets fewer)."""
        return min(
            most, max(self.cost.tokens_within(min(self.share, self.left), start), self.floor)
        )

    def spend(self, start: int, tokens: int) -> None:
        """Count a scheduled chunk against the time left."""
        self.left -= self.cost.seconds(tokens, start)
        self.floor = 0


@dataclass(slots=True)
class StepTimeModel:
    """Decode-only step time as a line in its rows; what prompt chunks add to a step, as a plane
    in their tokens and the context those attend to."""

    decode: WeightedLine = field(default_factory=WeightedLine)
    prompt: WeightedFit = field(default_factory=WeightedFit)

    def observe(
        self, prompt_tokens: int, decode_rows: int, seconds: float, context: int = 0
    ) -> None:
        """Record a step that computed `prompt_tokens` prompt tokens, attending to `context`
        tokens in all (context_sum of each chunk), beside `decode_rows` decodes in `seconds`."""
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
            added = _tempered(
                added, cost.fixed + cost.per_token * prompt_tokens + cost.per_context * context
            )
        self.prompt.add(prompt_tokens, context, added)

    def decode_only(self, rows: int) -> float | None:
        """The time a decode-only step of `rows` rows takes, or None before any was seen."""
        fitted = self.decode.fit(min_spread=0.5)
        return None if fitted is None else fitted[0] + fitted[1] * rows

    def prompt_cost(self) -> PromptCost | None:
        """What prompt chunks add to a step, or None before a step with prompt tokens was seen
        (or where they were seen to add nothing)."""
        fitted = self.prompt.fit()
        if fitted is None or (fitted[1] <= 0 and fitted[2] <= 0):
            return None
        return PromptCost(*fitted)

    def prompt_seconds(self, decode_rows: int, ratio: float) -> float | None:
        """The seconds prompt chunks may add to a step with `decode_rows` decodes beyond their
        fixed part, so that it takes at most `ratio` times their decode-only step, or MIN_STALL_S
        longer where that is more (0 where even that is all fixed part); None when there is no
        bound to give (nothing measured yet, no decodes, or ratio <= 1)."""
        if decode_rows <= 0 or ratio <= 1.0:
            return None
        decode_only, cost = self.decode_only(decode_rows), self.prompt_cost()
        if decode_only is None or cost is None:
            return None
        return max(max((ratio - 1.0) * decode_only, MIN_STALL_S) - cost.fixed, 0.0)


# Prompts get at least this many times the prompt work arriving per step, so prefill keeps
# ahead of arrivals whatever the step-time bound allows: a bound below the arrival rate would
# leave requests queueing for their prompt while fewer and fewer streams decode.
PACE_HEADROOM = 1.2
# Arrivals fade with this factor per step: the pace follows roughly the last 200 steps. Over a
# shorter window one long prompt's arrival (or a server's first burst) raises it so far that
# the steps after it take 2-3x the usual; a sudden rise in load is met by the burst factor
# (scheduler.py) before the pace catches up.
PACE_DECAY = 0.995


@dataclass(slots=True)
class PromptPace:
    """Prompt work arriving per step (new requests and preempted ones' recompute) — its tokens
    and the context they attend to — averaged over roughly the last 200 steps; one arrival's
    work counts for the steps after it."""

    tokens: float = 0.0
    context: float = 0.0
    _tokens: int = 0
    _context: int = 0

    def arrive(self, tokens: int) -> None:
        self._tokens += tokens
        self._context += context_sum(0, tokens)

    def step(self) -> None:
        """Fold in what arrived since the last step."""
        d = PACE_DECAY
        self.tokens = self.tokens * d + self._tokens * (1.0 - d)
        self.context = self.context * d + self._context * (1.0 - d)
        self._tokens = self._context = 0

    def seconds(self, cost: PromptCost) -> float:
        """The time a step's prompts must be allowed, beyond the fixed part, for prefill to keep
        ahead of arrivals."""
        return PACE_HEADROOM * (cost.per_token * self.tokens + cost.per_context * self.context)


def _tempered(seconds: float, expected: float | None) -> float:
    """A step's time, held within a factor of OUTLIER of what the fit expects: one step that
    the host stalled (another process, a page fault storm) moves the fit a little, not by the
    stall."""
    if expected is None or expected <= 0:
        return seconds
    return min(max(seconds, expected / OUTLIER), expected * OUTLIER)

"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.runtime.engine.structured_outputs import StructuredOutputsParams


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it (the HTTP layer maps it to `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


MAX_LOGPROBS = 20
# OpenAI's limits for logit_bias, kept so that a request valid there is valid here.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
# Above this, the temperature itself overflows float32 (to inf: every logit / inf is 0 or NaN).
MAX_TEMPERATURE = 3.0e38
# Below this temperature, dividing logits by it overflows float32 (1e-300 would give inf logits
# and a NaN distribution); the limit T -> 0 of sampling is greedy, so it is treated as greedy.
MIN_TEMPERATURE = 1e-5
# Dividing or multiplying logits by a penalty outside this range overflows them or flattens
# them to zero; HF's and vLLM's useful values lie well inside it.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# vLLM's bound: the seed of a request (as any integer field) must fit a signed 64-bit integer.
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Defaults match the OpenAI API's."""

    n: int = 1
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # in SEED_RANGE; completion i of n draws from seed + i
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the text's end
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per sampled token (0 = only the sampled one)
    # Log-probability of every prompt token after the first, with top-N alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id → value added to its logit before any other processing (-100 bans, +100 forces).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # What the text must be (a JSON schema, a regex, ...): enforced while decoding.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(name, message)

        check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        check(
            self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be <= {MAX_TEMPERATURE:g}, got {self.temperature}",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, "top_k", f"must be >= 0 (or -1 for off), got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        check(
            low <= self.repetition_penalty <= high,
            "repetition_penalty",
            f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        if self.seed is not None:
            low, high = SEED_RANGE
            check(low <= self.seed <= high, "seed", f"must be in [{low}, {high}], got {self.seed}")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if self.logprobs is not None:
            check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (as OpenAI), got {len(bias)}",
            )
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise SamplingParamsError(
                    "logit_bias", f"token ids must be integers >= 0, got {token!r}"
                )
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
            ):
                raise SamplingParamsError(
                    "logit_bias",
                    f"bias for token {token} must be a number in [{-MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {value!r}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

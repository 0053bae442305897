"""Speculative decoding's configuration: vLLM's `--speculative-config` JSON and the older flags
the guides still show (`--speculative-model`, `--num-speculative-tokens`, ...), read into one
frozen dataclass, checked once here."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

from kvfleet.runtime.engine.config_values import ConfigError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 32
DEFAULT_PROMPT_LOOKUP = 5
# vLLM's old spelling of the n-gram proposer as a "model".
NGRAM_MODEL_NAMES = ("[ngram]", "ngram")
# Speculation runs while at most this many sequences run: above it a step is no longer bound by
# streaming the weights once, and the rows a verify step adds cost about what they save
# (docs/benchmarks.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


class SpeculativeConfigError(ConfigError):
    """A speculative setting is out of range; the message names the key and the limit."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How each step's draft tokens are proposed, and how many."""

    method: str  # ngram: prompt lookup; draft_model: a small model with the same tokenizer
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix matched against earlier tokens. As in vLLM, one
    # not given is the other; neither: 5 and 5 (a short match proposes noise where nothing
    # is copied, and each rejected draft costs a row of the step).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # draft_model: as for --model (folder, Hub id, .gguf, bundled)
    revision: str | None = None  # draft_model: a Hub draft's revision
    quantization: str | None = None  # draft_model: as for --quantization
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method: must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                "speculative_config.num_speculative_tokens: must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", lo)  # frozen: resolved once, here
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= MAX_PROMPT_LOOKUP):
            raise SpeculativeConfigError(
                "speculative_config.prompt_lookup_min/max: need 1 <= min <= max <= "
                f"{MAX_PROMPT_LOOKUP}, got min {lo!r}, max {hi!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise SpeculativeConfigError(
                "speculative_config.model: the draft_model method needs a draft model"
            )
        if self.method == "ngram" and self.model:
            raise SpeculativeConfigError(
                f"speculative_config.model: the ngram method takes no model, got {self.model!r}"
            )
        b = self.disable_by_batch_size
        if not isinstance(b, int) or b < 1:
            raise SpeculativeConfigError(
                f"speculative_config.disable_by_batch_size: must be an integer >= 1, got {b!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's JSON keys; a `model` without a `method` is a draft model (or, spelled
        "[ngram]", the n-gram proposer), as vLLM reads it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                f"supported: {', '.join(sorted(known))}"
            )
        values = dict(values)
        model = values.get("model")
        if model in NGRAM_MODEL_NAMES:
            values["model"] = None
            values.setdefault("method", "ngram")
        elif values.get("method") is None:
            values["method"] = "draft_model" if model else "ngram"
        if "num_speculative_tokens" not in values:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens: required")
        return cls(**values)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """--speculative-config's value: a JSON object."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(
                f"speculative_config: not valid JSON ({exc.msg} at character {exc.pos})"
            ) from None
        if not isinstance(values, dict):
            raise SpeculativeConfigError("speculative_config: must be a JSON object")
        return cls.from_dict(values)


def as_speculative_config(value: object) -> SpeculativeConfig | None:
    """EngineConfig's field from what a caller may give: None, a SpeculativeConfig, a dict of
    vLLM's keys, or their JSON text."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict):
        return SpeculativeConfig.from_dict(value)
    if isinstance(value, str):
        return SpeculativeConfig.parse(value)
    raise SpeculativeConfigError(
        f"speculative_config: a JSON object, a dict or a SpeculativeConfig, got "
        f"{type(value).__name__}"
    )


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """--speculative-config, and the older flags as aliases of its keys."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4} (prompt lookup: drafts copied from earlier tokens), or '
        '{"model": "<draft>", "num_speculative_tokens": 4} (a small model with the same '
        'tokenizer); "disable_by_batch_size": speculate only while at most this many sequences '
        f"run (default {DEFAULT_DISABLE_BY_BATCH_SIZE})",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        help='older spelling: the draft model, or "[ngram]" for prompt lookup',
    )
    g.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="older spelling: draft tokens"
    )
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=None, help="older spelling")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=None, help="older spelling")
    g.add_argument(
        "--speculative-disable-by-batch-size", type=int, default=None, help="older spelling"
    )


_ALIASES = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
}


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The config the flags describe: the JSON, with any older flag given overriding its key."""
    text = getattr(args, "speculative_config", None)
    values: dict[str, Any] = {}
    if text is not None:
        parsed = SpeculativeConfig.parse(text)
        values = {f.name: getattr(parsed, f.name) for f in fields(parsed)}
    given = {
        key: getattr(args, flag)
        for flag, key in _ALIASES.items()
        if getattr(args, flag, None) is not None
    }
    if not values and not given:
        return None
    merged = {**values, **given}
    if "model" in given:
        merged.pop("method", None)  # read again from the model, as vLLM would
    return SpeculativeConfig.from_dict(merged)

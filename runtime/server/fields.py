"""Typed, bounded fields read out of a decoded request body: each wrong type or out-of-range
value is an `APIError` naming the field and what it must be."""

from __future__ import annotations

import math
import re
from typing import Any

from kvfleet.runtime.engine.sampling_params import SamplingParams, SamplingParamsError
from kvfleet.runtime.server.errors import APIError
from kvfleet.runtime.server.structured_fields import GUIDED_FIELDS, structured_outputs

MAX_N = 64  # completions per prompt: beyond this one request could monopolise the batch
# Every integer field is a signed 64-bit integer (as in vLLM); field-specific ranges come on top.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def get_field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """body[name] checked against kind (int is accepted for float; bool never for numbers)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if kind is float and ok and not math.isfinite(value):
        raise APIError(400, f"{name}: must be a finite number, got {value}", param=name)
    if not ok:
        raise APIError(
            400, f"{name}: must be {_TYPE_NAMES[kind]}, got {type_name(value)}", param=name
        )
    if kind is int and not INT64_MIN <= value <= INT64_MAX:
        raise APIError(400, f"{name}: must fit a signed 64-bit integer, got {value}", param=name)
    return value


def is_int(value: Any) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX
    )


def int_list(body: dict[str, Any], name: str) -> list[int]:
    value = get_field(body, name, list, [])
    if not all(is_int(t) for t in value):
        raise APIError(
            400, f"{name}: must be an array of integers (each a signed 64-bit one)", param=name
        )
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise APIError(400, "stop: must be a string or an array of strings", param="stop")


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's shape: {"<token id>": bias}; JSON object keys are strings, so ids come as text.
    Ranges (bias, number of entries) are SamplingParams' to check, the vocabulary the engine's."""
    value = get_field(body, "logit_bias", dict, {})
    bias: dict[int, float] = {}
    for key, v in value.items():
        try:
            # int() alone would also take " 7", "+7" and "1_0"; past 4300 digits it raises.
            token = int(key) if re.fullmatch(r"-?[0-9]+", key) else None
        except ValueError:
            token = None
        if token is None:
            raise APIError(
                400,
                f"logit_bias: keys must be token ids written as integers, got {key[:40]!r}",
                param="logit_bias",
            )
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise APIError(
                400,
                f"logit_bias: bias for token {key} must be a number, got {type_name(v)}",
                param="logit_bias",
            )
        bias[token] = v
    return bias


# Fields of OpenAI's API, and vLLM's own, that change what is generated and that this server
# does not implement: silently ignoring them would return plain text to a client that asked
# for tool calls, a suffix or banned words, so they are refused by name.
UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "guided_whitespace_pattern",
    "bad_words",
    "allowed_token_ids",
    "logits_processors",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "use_beam_search",
)

# Fields read from both endpoints' bodies, and OpenAI's bookkeeping fields, which change
# nothing generated. Any other field is one this server does not know: it is accepted and
# named in a warning in the log, as vLLM does (a client built for another server's extras
# keeps working), and README's "Limits and errors" says so.
_SHARED_FIELDS = frozenset(
    (
        *UNSUPPORTED_FIELDS,
        *("model", "max_tokens", "n", "best_of", "seed", "stream", "stream_options", "user"),
        *("temperature", "top_p", "top_k", "min_p", "logit_bias", "logprobs"),
        *("repetition_penalty", "presence_penalty", "frequency_penalty"),
        *("stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens"),
        *("skip_special_tokens", "response_format", "guided_decoding_backend"),
        *GUIDED_FIELDS,
        "structured_outputs",
        *("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"),
    )
)
# tools are the chat endpoint's: on /v1/completions they are refused unless they ask for nothing.
COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "echo", "suffix", "tools", "tool_choice"}
CHAT_FIELDS = _SHARED_FIELDS | {
    *("messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"),
    *("tools", "tool_choice"),
    *("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"),
}


def unknown_fields(body: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """The body's fields this server does not know, sorted (for the log's warning); a null
    asks for nothing, so it is not named."""
    return tuple(sorted(k for k, v in body.items() if k not in known and v is not None))


def _asks_for_nothing(name: str, value: Any) -> bool:
    """Absent, or a value client frameworks send by default that asks for nothing: no tools,
    or "do not call one"."""
    if value is None:
        return True
    if name in ("tools", "functions"):
        return isinstance(value, list) and not value
    if name in ("tool_choice", "function_call"):
        return value == "none"
    if name in ("bad_words", "logits_processors"):
        return isinstance(value, list) and not value
    if name == "use_beam_search":
        return value is False
    return False


def reject_unsupported(body: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    for name in (*UNSUPPORTED_FIELDS, *extra):
        if not _asks_for_nothing(name, body.get(name)):
            raise unsupported(name)
    best_of = get_field(body, "best_of", int)
    if best_of is not None and best_of != get_field(body, "n", int, 1):
        raise unsupported(
            "best_of",
            f"{best_of} is not supported by this server; it must equal n (every completion "
            f"generated is returned)",
        )


def unsupported(name: str, detail: str = "is not supported by this server") -> APIError:
    return APIError(400, f"{name}: {detail}", param=name, code="unsupported_parameter")


def stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """`stream_options`: (include_usage, continuous_usage_stats). The second is vLLM's: every
    chunk then carries the usage so far, which lets a client count tokens rather than chunks."""
    options = get_field(body, "stream_options", dict)
    if options is None:
        return False, False
    if not stream:
        raise APIError(
            400, "stream_options: only allowed when stream is true", param="stream_options"
        )
    include = bool(get_field(options, "include_usage", bool, False))
    continuous = bool(get_field(options, "continuous_usage_stats", bool, False))
    return include, include and continuous


def sampling_params(
    body: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    n = get_field(body, "n", int, 1)
    if n > MAX_N:
        raise APIError(400, f"n: must be <= {MAX_N}, got {n}", param="n")
    get_field(body, "user", str)
    try:
        return SamplingParams(
            n=n,
            temperature=get_field(body, "temperature", float, 1.0),
            top_p=get_field(body, "top_p", float, 1.0),
            top_k=get_field(body, "top_k", int, 0),
            min_p=get_field(body, "min_p", float, 0.0),
            repetition_penalty=get_field(body, "repetition_penalty", float, 1.0),
            presence_penalty=get_field(body, "presence_penalty", float, 0.0),
            frequency_penalty=get_field(body, "frequency_penalty", float, 0.0),
            seed=get_field(body, "seed", int),
            max_tokens=max_tokens,
            min_tokens=get_field(body, "min_tokens", int, 0),
            stop=_stop(body),
            stop_token_ids=int_list(body, "stop_token_ids"),
            include_stop_str_in_output=get_field(body, "include_stop_str_in_output", bool, False),
            ignore_eos=get_field(body, "ignore_eos", bool, False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
            logit_bias=_logit_bias(body),
            structured_outputs=structured_outputs(body),
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


def model_field(body: dict[str, Any]) -> str | None:
    return get_field(body, "model", str)

"""The OpenAI wire format: request parsing and validation, response and stream-chunk shapes.

Pure functions over JSON-decoded bodies: no I/O, no engine. Every rejection is an `APIError`
whose message names the field and the limit, rendered in OpenAI's error shape.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.request import CompletionOutput, TokenLogprob
from kvfleet.runtime.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

MAX_N = 64  # completions per prompt: beyond this one request could monopolise the batch
MAX_PROMPTS = 256  # prompts in one /v1/completions request
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# JSON has no -Infinity: a token the sampler could never pick is reported as this (as vLLM does).
LOGPROB_FLOOR = -9999.0
# Every integer field is a signed 64-bit integer (as in vLLM); field-specific ranges come on top.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# No OpenAI request nests deeper than a few levels (content parts, chat_template_kwargs); a
# limit keeps every walk over a body far from Python's recursion limit.
MAX_JSON_DEPTH = 32

TokenText = Callable[[int], str]


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _error_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool


@dataclass(slots=True)
class ChatTemplateOptions:
    """How the conversation is rendered (vLLM's extra chat fields)."""

    add_generation_prompt: bool = True  # open an assistant turn for the reply
    continue_final_message: bool = False  # leave the last (assistant) message open, extend it
    kwargs: dict[str, Any] = field(default_factory=dict)  # variables for the template


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    template: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)


# --- the body --------------------------------------------------------------------------------
def parse_json_body(raw: bytes) -> Any:
    """The decoded JSON of a request body, refused (400) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds a string that is not valid Unicode (a lone surrogate such as
    "\\ud800", which JSON's escapes allow but no tokenizer takes)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"body: not valid JSON ({exc})", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(
            400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from exc
    _check_json_tree(body)
    return body


def _check_json_tree(body: Any) -> None:
    # Iterative, so that its own depth never matters.
    stack: list[tuple[Any, str, int]] = [(body, "body", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, where)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise APIError(
                400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, where)
                stack.append((item, key if where == "body" else f"{where}.{key}", depth + 1))
        else:
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_unicode(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise APIError(
            400,
            f"{where}: holds {bad!r} at position {exc.start}, a lone surrogate that is not a "
            f"Unicode character; encode the text as UTF-8 (surrogate pairs must come in pairs)",
            param=where,
            code="invalid_unicode",
        ) from exc


# --- field access ----------------------------------------------------------------------------
_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def _type_name(value: Any) -> str:
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


def _get(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
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
            400, f"{name}: must be {_TYPE_NAMES[kind]}, got {_type_name(value)}", param=name
        )
    if kind is int and not INT64_MIN <= value <= INT64_MAX:
        raise APIError(400, f"{name}: must fit a signed 64-bit integer, got {value}", param=name)
    return value


def _is_int(value: Any) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX
    )


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = _get(body, name, list, [])
    if not all(_is_int(t) for t in value):
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
    value = _get(body, "logit_bias", dict, {})
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
                f"logit_bias: bias for token {key} must be a number, got {_type_name(v)}",
                param="logit_bias",
            )
        bias[token] = v
    return bias


# Fields of OpenAI's API this server does not implement: silently ignoring them would return
# plain text to a client that asked for tool calls, JSON or a suffix, so they are refused.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call")


def _asks_for_nothing(name: str, value: Any) -> bool:
    """Absent, or a value client frameworks send by default that asks for nothing: no tools,
    or "do not call one", which is what this server does anyway. (parallel_tool_calls only
    shapes tool calls, which are refused, so it is accepted whatever it says.)"""
    if value is None:
        return True
    if name in ("tools", "functions"):
        return isinstance(value, list) and not value
    if name in ("tool_choice", "function_call"):
        return value == "none"
    return False


def _reject_unsupported(body: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    for name in (*UNSUPPORTED_FIELDS, *extra):
        if not _asks_for_nothing(name, body.get(name)):
            raise _unsupported(name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        what = (
            f"type {response_format.get('type')!r}"
            if isinstance(response_format, dict)
            else f"a value of type {_type_name(response_format)}"
        )
        raise _unsupported(
            "response_format",
            f'{what} is not supported by this server; only {{"type": "text"}} is',
        )
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != _get(body, "n", int, 1):
        raise _unsupported(
            "best_of",
            f"{best_of} is not supported by this server; it must equal n (every completion "
            f"generated is returned)",
        )


def _unsupported(name: str, detail: str = "is not supported by this server") -> APIError:
    return APIError(400, f"{name}: {detail}", param=name, code="unsupported_parameter")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = _get(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise APIError(
            400, "stream_options: only allowed when stream is true", param="stream_options"
        )
    return bool(_get(options, "include_usage", bool, False))


def _sampling_params(
    body: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    n = _get(body, "n", int, 1)
    if n > MAX_N:
        raise APIError(400, f"n: must be <= {MAX_N}, got {n}", param="n")
    _get(body, "user", str)
    try:
        return SamplingParams(
            n=n,
            temperature=_get(body, "temperature", float, 1.0),
            top_p=_get(body, "top_p", float, 1.0),
            top_k=_get(body, "top_k", int, 0),
            min_p=_get(body, "min_p", float, 0.0),
            repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
            presence_penalty=_get(body, "presence_penalty", float, 0.0),
            frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
            seed=_get(body, "seed", int),
            max_tokens=max_tokens,
            min_tokens=_get(body, "min_tokens", int, 0),
            stop=_stop(body),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
            ignore_eos=_get(body, "ignore_eos", bool, False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
            logit_bias=_logit_bias(body),
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


def _model(body: dict[str, Any]) -> str | None:
    return _get(body, "model", str)


# --- requests --------------------------------------------------------------------------------
def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {_type_name(body)}")
    _reject_unsupported(body, ("suffix",))
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "prompt: is required", param="prompt")
    prompts = _prompts(body["prompt"])
    stream = _get(body, "stream", bool, False)
    echo = _get(body, "echo", bool, False)
    logprobs = _get(body, "logprobs", int)
    # Echo with logprobs scores the prompt too, with as many alternatives per token.
    prompt_logprobs = logprobs if echo else None
    return CompletionRequest(
        model=_model(body),
        prompts=prompts,
        params=_sampling_params(body, _get(body, "max_tokens", int, 16), logprobs, prompt_logprobs),
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(_is_int(t) for t in x)

    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif is_ids(prompt) and prompt:
        prompts = [prompt]
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)) or (
        isinstance(prompt, list) and prompt and all(is_ids(p) for p in prompt)
    ):
        prompts = list(prompt)
    else:
        raise APIError(
            400,
            "prompt: must be a non-empty string, array of strings, array of token ids or "
            "array of token-id arrays",
            param="prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise APIError(
            400, f"prompt: at most {MAX_PROMPTS} prompts, got {len(prompts)}", param="prompt"
        )
    for p in prompts:
        if len(p) == 0:
            raise APIError(400, "prompt: must not be empty", param="prompt")
    return prompts


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {_type_name(body)}")
    _reject_unsupported(body, ("chat_template",))
    messages = _messages(body.get("messages"))
    stream = _get(body, "stream", bool, False)
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(
            400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs"
        )
    logprobs = (top or 0) if want_logprobs else None
    return ChatRequest(
        model=_model(body),
        messages=messages,
        params=_sampling_params(body, max_tokens, logprobs),
        stream=stream,
        include_usage=_stream_options(body, stream),
        template=_chat_template_options(body, messages),
    )


# apply_chat_template's own arguments: a template variable of one of these names would change
# how the template is applied, not what it renders, so chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _chat_template_options(
    body: dict[str, Any], messages: list[dict[str, str]]
) -> ChatTemplateOptions:
    add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    continue_final = _get(body, "continue_final_message", bool, False)
    if continue_final and add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message: cannot be true while add_generation_prompt is true (the "
            "default); set add_generation_prompt to false to extend the last message",
            param="continue_final_message",
        )
    if continue_final and messages[-1]["role"] != "assistant":
        raise APIError(
            400,
            f"continue_final_message: the last message must be the assistant's, got role "
            f"{messages[-1]['role']!r}",
            param="continue_final_message",
        )
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(
                400,
                f"chat_template_kwargs: {key[:40]!r} cannot be a template variable (names must "
                f"be identifiers other than apply_chat_template's own arguments)",
                param="chat_template_kwargs",
            )
    return ChatTemplateOptions(add_generation_prompt, continue_final, dict(kwargs))


@dataclass(slots=True)
class TokenizeRequest:
    """/tokenize (vLLM's): a text prompt, or a conversation rendered by the chat template."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    template: ChatTemplateOptions
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """Validate a /tokenize body: exactly one of `prompt` (a string) and `messages`."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {_type_name(body)}")
    if body.get("chat_template") is not None:
        raise _unsupported("chat_template")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError(
            400, "prompt: give either prompt or messages, not both or neither", param="prompt"
        )
    messages = _messages(body["messages"]) if has_messages else None
    return TokenizeRequest(
        model=_model(body),
        prompt=_get(body, "prompt", str),
        messages=messages,
        template=_chat_template_options(body, messages) if messages else ChatTemplateOptions(),
        # As in vLLM: a text prompt gets the tokenizer's special tokens (what /v1/completions
        # encodes), a rendered conversation none (its template writes them).
        add_special_tokens=_get(body, "add_special_tokens", bool, not has_messages),
        return_token_strs=_get(body, "return_token_strs", bool, False),
    )


def parse_detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    """Validate a /detokenize body: (model, token ids)."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {_type_name(body)}")
    if body.get("tokens") is None:
        raise APIError(400, "tokens: is required", param="tokens")
    return _model(body), _int_list(body, "tokens")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where}: must be an object", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(
                400,
                f"{where}.role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                param=f"{where}.role",
            )
        out.append({"role": CHAT_ROLES[role], "content": _content(m.get("content"), where, role)})
    return out


def _content(content: Any, where: str, role: str) -> str:
    if content is None:
        # As OpenAI: only an assistant turn may come without content (it called tools).
        if role == "assistant":
            return ""
        raise APIError(
            400,
            f"{where}.content: is required in a {role} message (a string or an array of text "
            f"parts), got null",
            param=f"{where}.content",
        )
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise APIError(
                    400,
                    f"{where}.content[{j}]: only text parts are supported "
                    '({"type": "text", "text": ...})',
                    param=f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(
                    400, f"{where}.content[{j}].text: must be a string", param=f"{where}.content"
                )
            texts.append(text)
        return "".join(texts)
    raise APIError(
        400,
        f"{where}.content: must be a string or an array of text parts",
        param=f"{where}.content",
    )


# --- responses -------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def completion_logprobs(
    entries: list[TokenLogprob],
    token_text: TokenText,
    text_offset: int,
    prompt: list[tuple[int, TokenLogprob | None]] | None = None,
) -> dict[str, Any]:
    """The legacy completions logprobs object for the given tokens, after the echoed `prompt`'s
    (token id, logprob) pairs when given: its first token has no logprob, so nulls there."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, e in [*(prompt or []), *((e.token_id, e) for e in entries)]:
        t = token_text(token_id)
        tokens.append(t)
        token_logprobs.append(_lp(e.logprob) if e is not None else None)
        top.append({token_text(i): _lp(lp) for i, lp in e.top} if e is not None else None)
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        t = token_text(token_id)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
            for e in entries
        ]
    }


@dataclass(slots=True)
class ChoiceCursor:
    """What has been sent of one choice so far, to turn cumulative outputs into deltas."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token in the full text
    done: bool = False


@dataclass(slots=True)
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def take_delta(cursor: ChoiceCursor, out: CompletionOutput) -> Delta | None:
    """The new part of `out` since `cursor`, or None when nothing is new."""
    if cursor.done:
        return None
    text = out.text[cursor.text_len :]
    new_lp = (out.logprobs or [])[cursor.num_tokens :] if out.logprobs is not None else []
    if not text and not new_lp and out.finish_reason is None:
        return None
    cursor.text_len = len(out.text)
    cursor.num_tokens = len(out.token_ids)
    cursor.done = out.finish_reason is not None
    return Delta(text, list(new_lp), out.finish_reason)


def now() -> int:
    return int(time.time())

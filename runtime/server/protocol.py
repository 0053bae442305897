"""The OpenAI wire format of requests: each endpoint's body parsed and validated into what the
handlers need. Pure functions over JSON-decoded bodies: no I/O, no engine. Every rejection is
an `APIError` whose message names the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvfleet.runtime.engine.structured_outputs import (
    StructuredOutputError,
    StructuredOutputsParams,
    grammar_of,
)
from kvfleet.runtime.server.errors import APIError
from kvfleet.runtime.server.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    get_field,
    int_list,
    is_int,
    model_field,
    reject_unsupported,
    sampling_params,
    stream_options,
    type_name,
    unknown_fields,
    unsupported,
)
from kvfleet.runtime.server.tool_calls.forced import named_schema, required_schema
from kvfleet.runtime.server.tool_calls.messages import chat_message
from kvfleet.runtime.server.tool_calls.request import ToolsRequest, parse_tools

MAX_PROMPTS = 256  # prompts in one /v1/completions request
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    ignored: tuple[str, ...] = ()  # fields this server does not know, for the log


@dataclass(slots=True)
class ChatTemplateOptions:
    """How the conversation is rendered (vLLM's extra chat fields)."""

    add_generation_prompt: bool = True  # open an assistant turn for the reply
    continue_final_message: bool = False  # leave the last (assistant) message open, extend it
    kwargs: dict[str, Any] = field(default_factory=dict)  # variables for the template


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    template: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)
    tools: ToolsRequest | None = None  # the tools offered, and how they may be called
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    ignored: tuple[str, ...] = ()  # fields this server does not know, for the log


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a /v1/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type_name(body)}")
    reject_unsupported(body, ("suffix", "tools", "tool_choice"))
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "prompt: is required", param="prompt")
    prompts = _prompts(body["prompt"])
    stream = get_field(body, "stream", bool, False)
    echo = get_field(body, "echo", bool, False)
    logprobs = get_field(body, "logprobs", int)
    # Echo with logprobs scores the prompt too, with as many alternatives per token.
    prompt_logprobs = logprobs if echo else None
    usage, continuous = stream_options(body, stream)
    return CompletionRequest(
        model=model_field(body),
        prompts=prompts,
        params=sampling_params(
            body, get_field(body, "max_tokens", int, 16), logprobs, prompt_logprobs
        ),
        stream=stream,
        include_usage=usage,
        echo=echo,
        continuous_usage=continuous,
        ignored=unknown_fields(body, COMPLETION_FIELDS),
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(is_int(t) for t in x)

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
        raise APIError(400, f"body: must be a JSON object, got {type_name(body)}")
    reject_unsupported(body, ("chat_template",))
    messages = _messages(body.get("messages"))
    stream = get_field(body, "stream", bool, False)
    max_tokens = get_field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", int)
    want_logprobs = get_field(body, "logprobs", bool, False)
    top = get_field(body, "top_logprobs", int)
    if top is not None and not want_logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(
            400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs"
        )
    logprobs = (top or 0) if want_logprobs else None
    usage, continuous = stream_options(body, stream)
    params = sampling_params(body, max_tokens, logprobs)
    tools = parse_tools(body)
    if tools is not None and tools.choice in ("required", "named"):
        params.structured_outputs = _forced_call(tools, params.structured_outputs)
    return ChatRequest(
        model=model_field(body),
        messages=messages,
        params=params,
        stream=stream,
        include_usage=usage,
        template=_chat_template_options(body, messages),
        tools=tools,
        continuous_usage=continuous,
        ignored=unknown_fields(body, CHAT_FIELDS),
    )


def _forced_call(
    tools: ToolsRequest, constraint: StructuredOutputsParams | None
) -> StructuredOutputsParams:
    """tool_choice "required" or a named function, enforced as vLLM does: the output is
    constrained to the calls' JSON (forced.py), so the arguments always match the schema."""
    if constraint is not None:
        raise APIError(
            400,
            "tool_choice: a required or named tool call cannot be combined with "
            "response_format or another output constraint",
            param="tool_choice",
        )
    schema = required_schema(tools) if tools.choice == "required" else named_schema(tools)
    params = StructuredOutputsParams(json=schema)
    try:
        grammar_of(params)
    except StructuredOutputError as exc:
        raise APIError(
            400,
            f"tools: the tools' parameters cannot be enforced: {exc.message}",
            param="tools",
        ) from None
    return params


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
    add_generation_prompt = get_field(body, "add_generation_prompt", bool, True)
    continue_final = get_field(body, "continue_final_message", bool, False)
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
    kwargs = get_field(body, "chat_template_kwargs", dict, {})
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
        raise APIError(400, f"body: must be a JSON object, got {type_name(body)}")
    if body.get("chat_template") is not None:
        raise unsupported("chat_template")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError(
            400, "prompt: give either prompt or messages, not both or neither", param="prompt"
        )
    if has_prompt:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if body.get(name) is not None:
                raise APIError(
                    400, f"{name}: applies to messages only, not to a prompt", param=name
                )
    messages = _messages(body["messages"]) if has_messages else None
    return TokenizeRequest(
        model=model_field(body),
        prompt=get_field(body, "prompt", str),
        messages=messages,
        template=_chat_template_options(body, messages) if messages else ChatTemplateOptions(),
        # As in vLLM: a text prompt gets the tokenizer's special tokens (what /v1/completions
        # encodes), a rendered conversation none (its template writes them).
        add_special_tokens=get_field(body, "add_special_tokens", bool, not has_messages),
        return_token_strs=get_field(body, "return_token_strs", bool, False),
    )


def parse_detokenize_request(body: Any) -> tuple[str | None, list[int]]:
    """Validate a /detokenize body: (model, token ids)."""
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type_name(body)}")
    if body.get("tokens") is None:
        raise APIError(400, "tokens: is required", param="tokens")
    return model_field(body), int_list(body, "tokens")


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where}: must be an object", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise APIError(
                400,
                f"{where}.role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                param=f"{where}.role",
            )
        if role == "tool" or (role == "assistant" and m.get("tool_calls") is not None):
            out.append(chat_message(m, where))
            continue
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

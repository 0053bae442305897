"""The OpenAPI schemas of the request bodies: every field each endpoint reads, with the type and
range its parser enforces (fields.py, protocol.py, SamplingParams); and the schema helpers."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
)
from kvfleet.runtime.engine.structured_outputs import MAX_CHOICES, MAX_SPEC_CHARS
from kvfleet.runtime.server.fields import INT64_MAX, INT64_MIN, MAX_N
from kvfleet.runtime.server.protocol import MAX_PROMPTS, RESERVED_TEMPLATE_KWARGS
from kvfleet.runtime.server.tool_calls.request import MAX_TOOLS
from kvfleet.runtime.server.tool_calls.request import NAME_PATTERN as TOOL_NAME

Schema = dict[str, Any]

MAX_STOP_STRINGS = 16  # SamplingParams' limit (a literal there)
FINISH_REASONS = ["stop", "length", "abort", "error", "tool_calls"]
UNSUPPORTED = "Not supported: refused (400, code `unsupported_parameter`) unless null or"


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    """`schema` or null. Schemas that already take null, or any value, are kept."""
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return schema
    if isinstance(kind, str) and "enum" not in schema:
        return {**schema, "type": [kind, "null"]}
    if kind is None and not {"$ref", "anyOf", "oneOf", "enum", "const"} & schema.keys():
        return schema  # no constraint: null already passes
    return {"anyOf": [schema, {"type": "null"}]}


def optional(props: dict[str, Schema]) -> dict[str, Schema]:
    """The parser reads a null field as an absent one: every optional field takes null."""
    return {name: nullable(s) for name, s in props.items()}


def _doc(doc: str) -> Schema:
    return {"description": doc} if doc else {}


def integer(doc: str = "", minimum: int = INT64_MIN, maximum: int = INT64_MAX) -> Schema:
    # Every integer field is a signed 64-bit one (fields.get_field refuses any other).
    return {"type": "integer", "minimum": minimum, "maximum": maximum, **_doc(doc)}


def number(doc: str = "", **bounds: float) -> Schema:
    return {"type": "number", **bounds, **_doc(doc)}


def boolean(doc: str = "") -> Schema:
    return {"type": "boolean", **_doc(doc)}


def string(doc: str = "", **more: Any) -> Schema:
    return {"type": "string", **more, **_doc(doc)}


def array(items: Schema, doc: str = "", **more: Any) -> Schema:
    return {"type": "array", "items": items, **more, **_doc(doc)}


def obj(props: dict[str, Schema], required: str = "", **more: Any) -> Schema:
    """An object of `props`; `required` names the required ones, space-separated."""
    names = required.split()
    return {"type": "object", "properties": props, **({"required": names} if names else {}), **more}


def const(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


def refused(doc: str, allowed: Schema | None = None) -> Schema:
    """A field refused (400) unless it asks for nothing: null, or `allowed`."""
    return {**(allowed or {"type": "null"}), "description": doc}


TOKEN_ID = integer("A token id, below the model's vocabulary size (else 400).", minimum=0)
TOKEN_IDS = array(TOKEN_ID, minItems=1)
ANY_OBJECT: Schema = {"type": "object"}
# Structured outputs (structured_fields.py): at most one of response_format (other than text),
# the guided_* fields and structured_outputs in a request; each converted before queueing.
ONE = "At most one output constraint per request; one the grammar engine cannot enforce: 400."
JSON_SCHEMA: Schema = {"anyOf": [ANY_OBJECT, {"type": "string"}], "description": "Or its text."}
SPEC = string(minLength=1, maxLength=MAX_SPEC_CHARS)
CHOICES = array(string(minLength=1), minItems=1, maxItems=MAX_CHOICES)
UNSET: Schema = {"enum": [None, False]}  # a structured_outputs key that asks for nothing
ARGUMENTS = string(
    "A call's arguments: a JSON object, as text.",
    contentMediaType="application/json",
    contentSchema=ANY_OBJECT,
)


def needs(field: str, other: str, value: Any, unless: tuple[Any, ...] = (None,)) -> Schema:
    """A dependentSchemas entry: `field`, unless it is one of `unless`, needs `other` = `value`."""
    return {
        field: {
            "anyOf": [
                {"properties": {field: {"enum": list(unless)}}},
                {"properties": {other: {"const": value}}, "required": [other]},
            ]
        }
    }


STREAM_ONLY = needs("stream_options", "stream", True)


def sampling_properties(model: Schema) -> dict[str, Schema]:
    """The fields both generation endpoints read (fields._SHARED_FIELDS but logprobs)."""
    return optional(
        {
            "model": model,
            "max_tokens": integer(
                "Tokens to generate at most; prompt + max_tokens must fit max_model_len. "
                "Default: 16 for completions, up to max_model_len for chat.",
                minimum=1,
            ),
            "n": integer("Completions per prompt; prompts x n must fit the queue.", 1, MAX_N),
            "best_of": integer(
                "Accepted only equal to n (every completion is returned).", 1, MAX_N
            ),
            "seed": integer("Seeds sampling; completion i of n draws from seed + i."),
            "stream": boolean("Answer with Server-Sent Events, ending in `data: [DONE]`."),
            "stream_options": ref("StreamOptions"),
            "user": string("The end user's id (OpenAI's); not used."),
            "temperature": number("0 is greedy.", minimum=0),
            "top_p": number("Nucleus sampling's probability mass.", exclusiveMinimum=0, maximum=1),
            "top_k": integer(
                "Sample among the k likeliest (0 or -1: off); <= vocabulary size.", -1
            ),
            "min_p": number(
                "Drop tokens below min_p x the likeliest's probability.", minimum=0, maximum=1
            ),
            "logit_bias": ref("LogitBias"),
            "repetition_penalty": number(
                "vLLM's multiplicative penalty on tokens already seen.",
                minimum=REPETITION_PENALTY_RANGE[0],
                maximum=REPETITION_PENALTY_RANGE[1],
            ),
            "presence_penalty": number("OpenAI's presence penalty.", minimum=-2, maximum=2),
            "frequency_penalty": number("OpenAI's frequency penalty.", minimum=-2, maximum=2),
            "stop": ref("Stop"),
            "stop_token_ids": array(TOKEN_ID, "Token ids that end a completion (vLLM's)."),
            "include_stop_str_in_output": boolean("Keep the matched stop string in the text."),
            "ignore_eos": boolean("Generate past the end-of-sequence token."),
            "min_tokens": integer("Tokens generated before a stop can end it; <= max_tokens.", 0),
            "skip_special_tokens": boolean("Leave special tokens out of the text (default true)."),
            "guided_json": {
                **JSON_SCHEMA,
                "description": f"vLLM's: the output's JSON Schema. {ONE}",
            },
            "guided_regex": {**SPEC, "description": f"vLLM's: the output's regex. {ONE}"},
            "guided_choice": {
                **CHOICES,
                "description": f"vLLM's: the output is one of these. {ONE}",
            },
            "guided_grammar": {**SPEC, "description": f"vLLM's: the output's EBNF grammar. {ONE}"},
            "guided_whitespace_pattern": refused(f"vLLM's. {UNSUPPORTED} absent."),
            "guided_decoding_backend": {"description": "vLLM's grammar engine choice; not used."},
            "structured_outputs": ref("StructuredOutputs"),
            "response_format": ref("ResponseFormat"),
            "functions": refused(
                f"OpenAI's old tools. {UNSUPPORTED} empty.", array({}, maxItems=0)
            ),
            "function_call": refused(
                f'OpenAI\'s old tool_choice. {UNSUPPORTED} "none".', const("none")
            ),
            "bad_words": refused(f"{UNSUPPORTED} empty.", array({}, maxItems=0)),
            "allowed_token_ids": refused(f"{UNSUPPORTED} absent."),
            "logits_processors": refused(f"{UNSUPPORTED} empty.", array({}, maxItems=0)),
            "prompt_logprobs": refused(
                f"{UNSUPPORTED} absent; echo with logprobs scores a prompt."
            ),
            "truncate_prompt_tokens": refused(f"{UNSUPPORTED} absent."),
            "use_beam_search": refused(
                f"{UNSUPPORTED} false.", {"type": "boolean", "enum": [False]}
            ),
            # OpenAI's bookkeeping: never read, so any value passes.
            "metadata": {"description": "OpenAI's request metadata; not used."},
            "store": {"description": "OpenAI's stored completions; not used."},
            "service_tier": {"description": "OpenAI's service tier; not used."},
            "prompt_cache_key": {"description": "OpenAI's prompt-cache routing key; not used."},
            "safety_identifier": {"description": "OpenAI's end-user id; not used."},
        }
    )


def chat_template_properties() -> dict[str, Schema]:
    """vLLM's fields that shape how a conversation is rendered (chat and /tokenize)."""
    return optional(
        {
            "add_generation_prompt": boolean("Open the assistant's turn (default true)."),
            "continue_final_message": boolean(
                "Extend the last message, which must be the assistant's; needs "
                "add_generation_prompt false."
            ),
            "chat_template": refused(f"A template of the request's own. {UNSUPPORTED} absent."),
            "chat_template_kwargs": {
                "type": "object",
                "description": "Variables for the template: identifiers, none of "
                "apply_chat_template's own arguments.",
                "propertyNames": {
                    "pattern": r"^[^\W\d]\w*$",  # an identifier (\w: Unicode, as in Python)
                    "not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)},
                },
            },
        }
    )


def request_schemas(model: Schema) -> dict[str, Schema]:
    """The request bodies' component schemas, and the pieces they share."""
    content = ref("MessageContent")
    function = obj(
        {
            "name": string(pattern=f"^{TOOL_NAME.pattern}$"),
            **optional(
                {
                    "description": string(),
                    "parameters": {**ANY_OBJECT, "description": "A JSON Schema; absent: none."},
                    "strict": boolean(),
                }
            ),
        },
        "name",
    )
    return {
        "TextPart": obj({"type": const("text"), "text": string()}, "type text"),
        "MessageContent": {
            "anyOf": [string(), array(ref("TextPart"))],
            "description": "Text, or text parts (no other kind).",
        },
        "ToolCall": obj(
            {
                "id": string(),
                "type": const("function"),
                "function": obj({"name": string(), "arguments": ARGUMENTS}, "name arguments"),
            },
            "id type function",
        ),
        "ChatMessage": {
            "oneOf": [
                obj({"role": const("system", "developer"), "content": content}, "role content"),
                obj({"role": const("user"), "content": content}, "role content"),
                obj(
                    {
                        "role": const("assistant"),
                        "content": nullable(content),
                        "tool_calls": nullable(array(ref("ToolCall"))),
                    },
                    "role",
                ),
                obj(
                    {"role": const("tool"), "tool_call_id": string(), "content": content},
                    "role tool_call_id content",
                ),
            ],
        },
        "Messages": array(ref("ChatMessage"), "The conversation.", minItems=1),
        "Prompt": {
            "description": "A text, texts, a token-id array, or token-id arrays: each one prompt, "
            "not empty, shorter than max_model_len tokens.",
            "anyOf": [
                string(minLength=1),
                array(string(minLength=1), minItems=1, maxItems=MAX_PROMPTS),
                TOKEN_IDS,
                array(TOKEN_IDS, minItems=1, maxItems=MAX_PROMPTS),
            ],
        },
        "Stop": {
            "description": "Strings that end a completion (not included in it).",
            "anyOf": [
                string(minLength=1),
                array(string(minLength=1), maxItems=MAX_STOP_STRINGS),
            ],
        },
        "StreamOptions": obj(
            optional(
                {
                    "include_usage": boolean("End the stream with a chunk of the usage."),
                    "continuous_usage_stats": boolean("vLLM's: every chunk has usage so far."),
                }
            ),
            description="Only with stream true (else 400).",
        ),
        "LogitBias": {
            "type": "object",
            "description": "Token id (as a string) to the bias added to its logit.",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": number(minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS),
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
        },
        "ResponseFormat": {
            "oneOf": [
                obj({"type": const("text")}, "type"),
                obj({"type": const("json_object")}, "type"),
                obj(
                    {"type": const("json_schema"), "json_schema": ref("JSONSchemaFormat")},
                    "type json_schema",
                ),
            ],
        },
        "JSONSchemaFormat": obj(
            {
                "name": string(minLength=1),
                **optional(
                    {
                        "description": string(),
                        "schema": {**ANY_OBJECT, "description": "Absent: any JSON object."},
                        "strict": boolean(),
                    }
                ),
            },
            "name",
        ),
        "StructuredOutputs": obj(
            {
                name: {"anyOf": [schema, UNSET]}
                for name, schema in {
                    "json": JSON_SCHEMA,
                    "regex": SPEC,
                    "choice": CHOICES,
                    "grammar": SPEC,
                    "json_object": boolean("True: any JSON object."),
                }.items()
            }
            | {"disable_any_whitespace": {"description": "vLLM's; not used (compact JSON)."}},
            description=f"vLLM's: exactly one constraint on the output. {ONE}",
            # A key given null or false asks for nothing; any other key is refused.
            oneOf=[
                {"required": [k], "properties": {k: {"not": UNSET}}}
                for k in ("json", "regex", "choice", "grammar", "json_object")
            ],
            additionalProperties=UNSET,
        ),
        "Tool": obj({"type": const("function"), "function": function}, "type function"),
        "ToolChoice": {
            "description": 'Default: "auto" with tools ("auto" needs a server started with '
            '--enable-auto-tool-choice), else "none". "required" and a named function need '
            "tools, the function one of them.",
            "anyOf": [
                const("none", "auto", "required"),
                obj(
                    {"type": const("function"), "function": obj({"name": string()}, "name")},
                    "type function",
                ),
            ],
        },
        "CompletionRequest": obj(
            {
                **sampling_properties(model),
                "prompt": ref("Prompt"),
                **optional(
                    {
                        "logprobs": integer(
                            "Alternatives per token, with the sampled one's logprob.",
                            0,
                            MAX_LOGPROBS,
                        ),
                        "echo": boolean("Start the text with the prompt (scored, with logprobs)."),
                        "suffix": refused(f"{UNSUPPORTED} absent."),
                        # The chat endpoint's: here they may only ask for nothing.
                        "tools": refused(f"{UNSUPPORTED} empty.", array({}, maxItems=0)),
                        "tool_choice": refused(f'{UNSUPPORTED} "none".', const("none")),
                    }
                ),
            },
            "prompt",
            dependentSchemas=STREAM_ONLY,
        ),
        "ChatCompletionRequest": obj(
            {
                **sampling_properties(model),
                "messages": ref("Messages"),
                **chat_template_properties(),
                **optional(
                    {
                        "logprobs": boolean("Return each sampled token's logprob."),
                        "top_logprobs": integer(
                            "Alternatives per token; needs logprobs true.", 0, MAX_LOGPROBS
                        ),
                        "max_completion_tokens": integer("As max_tokens; wins over it.", minimum=1),
                        "tools": array(
                            ref("Tool"), "Functions the model may call.", maxItems=MAX_TOOLS
                        ),
                        "tool_choice": ref("ToolChoice"),
                        "parallel_tool_calls": boolean("Allow several calls in one turn."),
                    }
                ),
            },
            "messages",
            dependentSchemas={
                **STREAM_ONLY,
                **needs("top_logprobs", "logprobs", True),
                **needs(
                    "continue_final_message", "add_generation_prompt", False, unless=(False, None)
                ),
            },
        ),
        "TokenizeRequest": obj(
            {
                **optional(
                    {
                        "model": model,
                        "prompt": string("A text, tokenized with the special tokens."),
                        "messages": ref("Messages"),
                        "add_special_tokens": boolean(
                            "Default: true for prompt, false for messages."
                        ),
                        "return_token_strs": boolean("Also return each token's string."),
                    }
                ),
                **chat_template_properties(),
            },
            description="Exactly one of prompt and messages.",
            oneOf=[
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
        ),
        "DetokenizeRequest": obj({"model": nullable(model), "tokens": array(TOKEN_ID)}, "tokens"),
    }

"""The OpenAPI 3.1 document of the server, served at /openapi.json: every route, its request body
(openapi_requests), its answers and their errors. Client generators and schemathesis read it."""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.server.openapi_requests import (
    FINISH_REASONS,
    Schema,
    array,
    const,
    integer,
    nullable,
    number,
    obj,
    ref,
    request_schemas,
    string,
)

from kvfleet import __version__, contract

OPENAPI_PATH = "/openapi.json"
JSON = "application/json"

ERRORS = {
    "400": "Invalid request: a field's type or range, a field this server refuses, what the "
    "model cannot take (a prompt longer than max_model_len, a token id past its vocabulary, a "
    "conversation its chat template rejects), a body that is not JSON.",
    "401": "Missing or wrong API key.",
    "404": "The `model` named is not the one served here.",
    "413": "The body is larger than --max-body-bytes.",
    "503": "Loading, shutting down, or the queue is full (code `queue_full`): retry after "
    "Retry-After seconds, or on another replica.",
}


def openapi_document(
    model_names: list[str] | None = None, *, api_key: bool = True
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route. `model_names`, when given, are the values the
    requests' `model` field may take (any other is a 404); `api_key`: the API asks for one."""
    model = string("The served model's name; absent or null: the one served.")
    if model_names:
        model["enum"] = list(model_names)
    return {
        "openapi": "3.1.1",
        "info": {
            "title": "kvfleet",
            "version": __version__,
            "description": "An OpenAI-compatible LLM server, with vLLM's extra fields and "
            "routes. Every error is OpenAI's error object. A field this server does not know "
            "is accepted, ignored and named in its log (as vLLM does). An integer must be "
            "written as one: 2.0 where an integer is due is refused (400).",
        },
        "paths": _paths(api_key, model_names[0] if model_names else None),
        "components": {
            "schemas": {**request_schemas(model), **response_schemas()},
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The key the server was started with (--api-key or "
                    f"${contract.API_KEY_ENV}); a server started without one asks for none.",
                }
            },
        },
    }


def response_schemas() -> dict[str, Schema]:
    """The response bodies: OpenAI's objects, the streams' chunks, vLLM's extras, the error."""
    count = integer(minimum=0)
    finish = const(*FINISH_REASONS)
    stop_reason = {
        "type": ["string", "integer", "null"],
        "description": "The stop string or token id that ended the completion.",
    }
    head = {"id": string(), "created": count, "model": string()}
    heads = "id object created model choices"
    top = obj(
        {"token": string(), "logprob": number(), "bytes": array(count)}, "token logprob bytes"
    )
    text_choice = {
        "index": count,
        "text": string(),
        "logprobs": nullable(ref("CompletionLogprobs")),
    }
    chat_logprobs = nullable(ref("ChatLogprobs"))
    tool_calls = array(ref("ToolCall"))
    # A streamed call comes in pieces: index, id, type and name first, then its arguments.
    call_piece = obj(
        {
            "index": count,
            "id": string(),
            "type": const("function"),
            "function": obj({"name": string(), "arguments": string()}),
        },
        "index",
    )
    return {
        "Error": obj(
            {
                "message": string(),
                "type": string("invalid_request_error, authentication_error, not_found_error..."),
                "param": nullable(string("The field at fault, when one is.")),
                "code": nullable(string("The error's stable name, when it has one.")),
            },
            "message type param code",
            additionalProperties=False,
        ),
        "ErrorResponse": obj({"error": ref("Error")}, "error"),
        # What the 200 of a stream can end in. A server_error would be the stream's 500: no
        # correct request gets one, so it is not documented (as a 500 is not).
        "StreamError": {
            "allOf": [ref("ErrorResponse")],
            "properties": {"error": {"properties": {"type": {"not": {"const": "server_error"}}}}},
        },
        "Usage": obj(
            {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count},
            "prompt_tokens completion_tokens total_tokens",
        ),
        "CompletionLogprobs": obj(
            {
                "tokens": array(string()),
                "token_logprobs": array({"type": ["number", "null"]}),
                "top_logprobs": array(
                    {"type": ["object", "null"], "additionalProperties": number()}
                ),
                "text_offset": array(count),
            },
            "tokens token_logprobs top_logprobs text_offset",
        ),
        "Completion": obj(
            {
                **head,
                "object": const("text_completion"),
                "choices": array(
                    obj(
                        {**text_choice, "finish_reason": finish, "stop_reason": stop_reason},
                        "index text logprobs finish_reason stop_reason",
                    )
                ),
                "usage": ref("Usage"),
            },
            f"{heads} usage",
        ),
        "CompletionChunk": obj(
            {
                **head,
                "object": const("text_completion"),
                "choices": array(
                    obj(
                        {**text_choice, "finish_reason": nullable(finish)},
                        "index text logprobs finish_reason",
                    )
                ),
                "usage": nullable(ref("Usage")),
            },
            heads,
        ),
        "ChatTopLogprob": top,
        "ChatLogprobs": obj(
            {
                "content": array(
                    obj(
                        {**top["properties"], "top_logprobs": array(ref("ChatTopLogprob"))},
                        "token logprob bytes top_logprobs",
                    )
                )
            },
            "content",
        ),
        "ChatCompletion": obj(
            {
                **head,
                "object": const("chat.completion"),
                "choices": array(
                    obj(
                        {
                            "index": count,
                            "message": obj(
                                {
                                    "role": const("assistant"),
                                    "content": nullable(string()),
                                    "tool_calls": tool_calls,
                                },
                                "role content",
                            ),
                            "logprobs": chat_logprobs,
                            "finish_reason": finish,
                            "stop_reason": stop_reason,
                        },
                        "index message logprobs finish_reason stop_reason",
                    )
                ),
                "usage": ref("Usage"),
            },
            f"{heads} usage",
        ),
        "ChatCompletionChunk": obj(
            {
                **head,
                "object": const("chat.completion.chunk"),
                "choices": array(
                    obj(
                        {
                            "index": count,
                            "delta": obj(
                                {
                                    "role": const("assistant"),
                                    "content": string(),
                                    "tool_calls": array(call_piece),
                                }
                            ),
                            "logprobs": chat_logprobs,
                            "finish_reason": nullable(finish),
                        },
                        "index delta logprobs finish_reason",
                    )
                ),
                "usage": nullable(ref("Usage")),
            },
            heads,
        ),
        "Model": obj(
            {
                "id": string("The served name (--served-model-name)."),
                "object": const("model"),
                "created": count,
                "owned_by": string(),
                "root": string("The model loaded: a path or a Hub id."),
                "max_model_len": nullable(integer("Null while loading.", minimum=1)),
            },
            "id object created owned_by root max_model_len",
        ),
        "ModelList": obj({"object": const("list"), "data": array(ref("Model"))}, "object data"),
        "TokenizeResult": obj(
            {
                "count": count,
                "max_model_len": integer(minimum=1),
                "tokens": array(count),
                "token_strs": nullable(array(string())),
            },
            "count max_model_len tokens token_strs",
        ),
        "DetokenizeResult": obj({"prompt": string("The tokens' text.")}, "prompt"),
        "Health": obj({"status": const("ok", "loading", "draining", "engine stopped")}, "status"),
        "Version": obj({"version": string()}, "version"),
    }


def _content(schema: Schema, media_type: str = JSON) -> dict[str, Any]:
    return {"content": {media_type: {"schema": schema}}}


def _errors(*statuses: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in statuses:
        out[status] = {"description": ERRORS[status], **_content(ref("ErrorResponse"))}
        if status == "503":
            retry = {"schema": {"type": "string", "pattern": "^[0-9]+$"}, "required": True}
            out[status]["headers"] = {"Retry-After": retry}
    return out


def _stream_event(chunk: str) -> Schema:
    # Open API 3.1 has no schema for a stream's items (3.2's itemSchema): as schemathesis and
    # other tools read it, the `schema` of text/event-stream describes each event.
    json_data = {
        "contentMediaType": JSON,
        "contentSchema": {"anyOf": [ref(chunk), ref("StreamError")]},
    }
    return obj(
        {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}},
        "data",
        description=f"Each event of the stream: a {chunk} as JSON; an error object if the "
        "engine stops once streaming began; last, the text [DONE].",
    )


def _generation(response: str, chunk: str) -> dict[str, Any]:
    """The 200 of a generation route: one JSON object, or Server-Sent Events when streamed."""
    return {
        "content": {
            JSON: {"schema": ref(response)},
            "text/event-stream": {"schema": _stream_event(chunk)},
        }
    }


def _paths(keyed: bool, model: str | None) -> dict[str, Any]:
    """Every route; the API's own ask for the key, and may answer 401, when the server has one.
    `model` is named in the requests' examples."""
    named = {"model": model} if model else {}
    api_security = [{"apiKey": []}] if keyed else []
    denied = ("401",) if keyed else ()

    def op(operation_id: str, summary: str, ok: dict, *errors: str, open_: bool = False) -> dict:
        return {
            "operationId": operation_id,
            "summary": summary,
            "security": [] if open_ else api_security,
            "responses": {"200": {"description": "OK", **ok}, **_errors(*errors)},
        }

    def post(operation_id: str, summary: str, request: str, ok: dict, example: dict) -> dict:
        media = {"schema": ref(request), "example": {**named, **example}}
        body = {"required": True, "content": {JSON: media}}
        errors = ("400", *denied, "404", "413", "503")
        return {"post": {**op(operation_id, summary, ok, *errors), "requestBody": body}}

    health = op(
        "health", "200 once the model is loaded and serving.", _content(ref("Health")), open_=True
    )
    health["responses"]["503"] = {
        "description": "Loading, draining, or the engine stopped.",
        **_content(ref("Health")),
    }
    return {
        "/v1/completions": post(
            "createCompletion",
            "Complete prompts (OpenAI's legacy completions).",
            "CompletionRequest",
            _generation("Completion", "CompletionChunk"),
            {"prompt": "Once upon a time", "max_tokens": 16},
        ),
        "/v1/chat/completions": post(
            "createChatCompletion",
            "Answer a conversation, rendered by the model's chat template.",
            "ChatCompletionRequest",
            _generation("ChatCompletion", "ChatCompletionChunk"),
            {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16},
        ),
        contract.MODELS_PATH: {
            "get": op("listModels", "The model served.", _content(ref("ModelList")), *denied)
        },
        "/tokenize": post(
            "tokenize",
            "vLLM's: a prompt's or a conversation's token ids, without generating.",
            "TokenizeRequest",
            _content(ref("TokenizeResult")),
            {"prompt": "Hello, world"},
        ),
        "/detokenize": post(
            "detokenize",
            "vLLM's: the text of token ids.",
            "DetokenizeRequest",
            _content(ref("DetokenizeResult")),
            {"tokens": [1, 2, 3]},
        ),
        contract.HEALTH_PATH: {"get": health},
        contract.METRICS_PATH: {
            "get": op(
                "metrics",
                "Prometheus metrics, named as vLLM names them.",
                _content(string("Prometheus' text exposition format."), "text/plain"),
                open_=True,
            )
        },
        contract.VERSION_PATH: {
            "get": op("version", "The server's version.", _content(ref("Version")), open_=True)
        },
        OPENAPI_PATH: {
            "get": op("openapi", "This document.", _content({"type": "object"}), open_=True)
        },
    }

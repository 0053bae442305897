"""A request body's JSON, refused (400) unless it is JSON that every later step can take:
nested no deeper than MAX_JSON_DEPTH and holding only valid Unicode text."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from kvfleet.runtime.server.errors import APIError

# No OpenAI request nests deeper than a few levels (content parts, chat_template_kwargs); a
# limit keeps every walk over a body far from Python's recursion limit.
MAX_JSON_DEPTH = 32


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


async def read_json_body(request: web.Request, limit: int) -> Any:
    """`parse_json_body` of a request's body, refused (413) beyond `limit` bytes: by its
    Content-Length before reading, else by what arrives."""
    too_large = f"body: exceeds the limit of {limit} bytes (--max-body-bytes)"
    if request.content_length is not None and request.content_length > limit:
        raise APIError(
            413,
            f"body: {request.content_length} bytes exceeds the limit of "
            f"{limit} bytes (--max-body-bytes)",
            code="body_too_large",
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, too_large, code="body_too_large") from exc
    if len(raw) > limit:
        raise APIError(
            413,
            f"body: {len(raw)} bytes exceeds the limit of {limit} bytes (--max-body-bytes)",
            code="body_too_large",
        )
    return parse_json_body(raw)

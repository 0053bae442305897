"""An aiohttp runner whose own error answers are OpenAI error objects too.

Errors found before any handler runs (a malformed request line, headers over aiohttp's size
limits, a broken chunked body) are answered by aiohttp's protocol handler with a plain-text
page that no middleware sees. aiohttp offers no hook for that page, so the runner hands
connections to a protocol handler subclass that renders it in OpenAI's shape.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from kvfleet.runtime.server.api_error import APIError


class _OpenAIErrorHandler(RequestHandler):
    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        self.log_debug("protocol error %s from %s: %s", status, request.remote, exc or message)
        if request.writer.output_size > 0:  # as aiohttp: a response has begun, none can follow
            raise ConnectionError("response already started; cannot send an error")
        if status == HTTPStatus.INTERNAL_SERVER_ERROR:
            text = "internal error while reading the request"
        else:
            # aiohttp's message names the limit (e.g. "Got more than 8190 bytes when reading").
            text = f"bad HTTP request: {(message or HTTPStatus(status).phrase)[:300]}"
        resp = web.Response(
            status=status,
            text=json.dumps(APIError(status, text, code="bad_http_request").body()),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class _OpenAIErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


class OpenAIAppRunner(web.AppRunner):
    """`web.AppRunner` whose protocol-level error pages are OpenAI error objects."""

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return _OpenAIErrorServer(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )

"""The one error shape every answer uses: OpenAI's {"error": {"message", "type", "param",
"code"}} (`APIError`, in api_error.py), and what the client is told of each exception."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from kvfleet.runtime.engine.async_engine import EngineDeadError, RequestFailedError
from kvfleet.runtime.engine.request_limits import RequestError
from kvfleet.runtime.server.api_error import APIError

__all__ = ["APIError", "api_error"]

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)


def api_error(exc: Exception, request: web.Request) -> APIError:
    """What the client is told of an exception: its own error for the expected ones, and for a
    bug a 500 that names the request in the log where its traceback is."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="request_failed")
    request_id = uuid.uuid4().hex[:16]
    log.error("internal error %s on %s %s", request_id, request.method, request.path, exc_info=exc)
    return APIError(
        500,
        f"internal error {request_id} while handling the request; the server logged it",
        code="internal_error",
    )

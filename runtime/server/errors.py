"""The one error shape every answer uses: OpenAI's {"error": {"message", "type", "param",
"code"}}."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from kvfleet.runtime.engine.async_engine import EngineDeadError, RequestFailedError
from kvfleet.runtime.engine.request_limits import RequestError

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)


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

"""Sending one request to one replica and relaying its answer to the client.

A JSON answer is relayed whole, with its status (kvfleet serve's errors are already OpenAI
error objects). An event stream is relayed event by event as it comes, without buffering the
answer; if the upstream breaks off or ends without `[DONE]`, the client gets an OpenAI error
event and `[DONE]`, so a stream always ends the way clients expect. A client that hangs up
cancels the handler (handler_cancellation), which closes the upstream connection, and the
replica aborts the generation.

Failures before anything reached the client raise `UpstreamFailed`, which says whether
another replica may be tried: yes for a refused connection or a 503 (the replica is loading,
draining or full; nothing was generated), no for a timeout (the work may be under way).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp
from aiohttp import web
from kvfleet.runtime.router.sse_events import EventFramer, is_done
from kvfleet.runtime.server.api_error import APIError

# Request headers that belong to one connection, not to the request (RFC 9110, 7.6.1), and
# those the client session sets itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_RELAYED_RESPONSE_HEADERS = ("Content-Type", "Retry-After")


class UpstreamFailed(Exception):
    """Nothing reached the client; `answer` is what to tell it if no other replica serves."""

    def __init__(self, kind: str, answer: web.Response, retryable: bool, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # metrics.ERROR_KINDS
        self.answer = answer
        self.retryable = retryable


def forwarded_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    upstream: str,
    body: bytes | None,
    timeout: aiohttp.ClientTimeout,
    on_stream_error: Callable[[str], None] = lambda reason: None,
) -> web.StreamResponse:
    """Send `request` (its method, path and `body`) to `upstream` and relay the answer.
    Raises UpstreamFailed before the answer began; returns the relayed response otherwise
    (a stream that broke off calls `on_stream_error` with the reason)."""
    url = upstream + request.rel_url.path_qs
    try:
        up = await session.request(
            request.method, url, data=body, headers=forwarded_headers(request), timeout=timeout
        )
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        # Nothing was sent: the replica is down or unreachable.
        raise _failed(
            "connect", 502, f"upstream {upstream}: {exc or 'connect timeout'}", True
        ) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        # Closed or reset before any answer (a replica that just stopped, or was killed while
        # it computed ours): the client has seen nothing, so another replica may serve it.
        message = f"upstream {upstream} closed the connection: {exc}"
        raise _failed("connect", 502, message, True) from exc
    except TimeoutError as exc:
        raise _failed("timeout", 504, f"upstream {upstream}: no answer in time", False) from exc
    except aiohttp.ClientError as exc:
        raise _failed("connect", 502, f"upstream {upstream}: {exc}", False) from exc

    try:
        if up.content_type != "text/event-stream" or up.status != 200:
            return await _relay_whole(up, upstream)
        return await _relay_stream(request, up, upstream, on_stream_error)
    finally:
        # Releasing an answer not read to its end closes its connection (it cannot be reused):
        # when the client left mid-stream, the replica sees it gone and aborts the request.
        up.release()


async def _relay_whole(up: aiohttp.ClientResponse, upstream: str) -> web.Response:
    try:
        payload = await up.read()
    except TimeoutError as exc:
        raise _failed("timeout", 504, f"upstream {upstream}: no answer in time", False) from exc
    except aiohttp.ClientError as exc:
        # A whole answer reaches the client only once read: nothing has, so another replica
        # may serve it.
        message = f"upstream {upstream} broke off its answer: {exc}"
        raise _failed("stream", 502, message, True) from exc
    headers = {h: up.headers[h] for h in _RELAYED_RESPONSE_HEADERS if h in up.headers}
    answer = web.Response(status=up.status, body=payload, headers=headers)
    if up.status == 503:  # loading, draining or queue full: another replica may take it
        raise UpstreamFailed("status", answer, True, f"upstream {upstream}: HTTP 503")
    if up.status >= 500:
        raise UpstreamFailed("status", answer, False, f"upstream {upstream}: HTTP {up.status}")
    return answer


async def _relay_stream(
    request: web.Request,
    up: aiohttp.ClientResponse,
    upstream: str,
    on_stream_error: Callable[[str], None],
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=up.status,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await resp.prepare(request)
    framer = EventFramer()
    done = False
    failure = ""
    try:
        async for chunk in up.content.iter_any():
            for event in framer.feed(chunk):
                await resp.write(event)
                done = done or is_done(event)
    except TimeoutError:
        failure = "no answer within the timeout"
    except aiohttp.ClientError as exc:
        failure = f"{type(exc).__name__}: {exc}"
    if not done:
        reason = failure or "the stream ended without [DONE]"
        err = APIError(
            502, f"upstream {upstream} failed mid-stream: {reason}", code="upstream_error"
        )
        await resp.write(f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode())
        on_stream_error(reason)
    await resp.write_eof()
    return resp


def _failed(kind: str, status: int, message: str, retryable: bool) -> UpstreamFailed:
    code = "upstream_timeout" if status == 504 else "upstream_unavailable"
    answer = web.json_response(APIError(status, message, code=code).body(), status=status)
    return UpstreamFailed(kind, answer, retryable, message)

"""The router's API key: the same check as `kvfleet serve`'s (`Authorization: Bearer <key>`,
compared in constant time, 401 in OpenAI's error shape), made before a request is routed, held
or wakes a Deployment from zero, so that one key (one Secret) guards the router, its activator
and the replicas alike. The client's header still goes on to the replica, which checks it too."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from kvfleet.runtime.server.api_error import APIError

from kvfleet import contract

# Probes and Prometheus read these without a key, as they do on the runtime.
OPEN_PATHS = frozenset({contract.HEALTH_PATH, contract.METRICS_PATH})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key the router requires: --api-key, else $KVFLEET_API_KEY, else None (open). An
    empty key is refused, not taken for "no key": it is what a Secret missing its value gives."""
    if flag is not None:
        if not flag.strip():
            raise ValueError("api_key: --api-key is empty; omit it to route without a key")
        return flag
    key = environ.get(contract.API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(
            f"api_key: ${contract.API_KEY_ENV} is set but empty; unset it to route without a key"
        )
    return key


def authorized(header: str, key: str) -> bool:
    """Whether an Authorization header carries `key` as a Bearer token."""
    scheme, _, token = header.partition(" ")
    # Constant-time comparison: the answer's timing must not reveal how much of a guess matched.
    matches = hmac.compare_digest(token.strip().encode(), key.encode())
    return scheme.lower() == "bearer" and matches


def api_key_middleware(key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware that answers 401 to a request without the key (OPEN_PATHS aside)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not authorized(
            request.headers.get("Authorization", ""), key
        ):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return await handler(request)

    return check

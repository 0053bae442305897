"""The operator's liveness endpoint, served by the process itself rather than by kopf.

A standby replica does not run kopf until it holds the lease, yet the kubelet probes it all the
same: were the endpoint kopf's, every standby would be restarted for waiting. An answer means
the process's event loop runs, which is what kopf's own endpoint reports too.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web


async def serve_liveness(url: str) -> web.AppRunner:
    """Answer GET on the URL's path (e.g. http://0.0.0.0:8081/healthz) with 200 until the
    returned runner is cleaned up."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.port:
        raise ValueError(f"--liveness: expected http://HOST:PORT/PATH, got {url!r}")

    async def alive(_: web.Request) -> web.Response:
        return web.json_response({"alive": True})

    app = web.Application()
    app.router.add_get(parts.path or "/", alive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port).start()
    return runner

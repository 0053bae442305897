"""The router's HTTP front: OpenAI's generation endpoints relayed to a replica each, picked by
prompt prefix and load (policy.py), plus /v1/models, /tokenize and /detokenize (relayed to any
replica), /health and the router's /metrics. With an API key, every request but /health and
/metrics must carry it (api_key.py) before it is routed, held or wakes a Deployment.

A request goes to one replica; if that one refuses the connection or answers 503 before
anything reached the client, it goes to the next pick (up to `max_attempts` replicas). With
no healthy replica it waits up to `wait_for_replica` seconds for one, then answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from kvfleet.runtime.router import activator as act
from kvfleet.runtime.router.api_key import api_key_middleware
from kvfleet.runtime.router.discovery import PodDiscovery
from kvfleet.runtime.router.forward import UpstreamFailed, forward
from kvfleet.runtime.router.metrics import RouterMetrics
from kvfleet.runtime.router.placement import PlacementTable
from kvfleet.runtime.router.policy import Placement, pick_replica
from kvfleet.runtime.router.prefix_key import prefix_key
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.scraper import scrape_forever, scrape_once
from kvfleet.runtime.router.settings import RouterSettings
from kvfleet.runtime.server.api_error import APIError
from prometheus_client import CONTENT_TYPE_LATEST

from kvfleet import contract

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class Router:
    """Routes and the background scrape. `app()` builds the aiohttp application."""

    def __init__(
        self,
        pool: ReplicaPool,
        settings: RouterSettings,
        discovery: PodDiscovery | None = None,
        activator: act.ActivatorSettings | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        if pool.placement is None and settings.placement_table_size:
            pool.placement = PlacementTable(settings.placement_table_size)
        self.discovery = discovery  # None: the replicas are the fixed --upstream list
        self.metrics = RouterMetrics(pool)
        # None: no scale from zero; a request with no ready replica waits --wait-for-replica.
        self.activator = act.Activator(pool, activator, self.metrics) if activator else None
        self._rng = random.Random(settings.seed)
        self._session: aiohttp.ClientSession | None = None
        self._scraper: asyncio.Task[None] | None = None
        self._discoverer: asyncio.Task[None] | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=settings.request_timeout,
            connect=settings.connect_timeout,
            sock_connect=settings.connect_timeout,
        )

    def app(self) -> web.Application:
        middlewares = [self._errors]  # first: it answers the key check's 401 too
        if self.settings.api_key:
            middlewares.append(api_key_middleware(self.settings.api_key))
        app = web.Application(
            middlewares=middlewares, client_max_size=self.settings.max_body_bytes + 1
        )
        app.router.add_get(contract.HEALTH_PATH, self.health)
        app.router.add_get(contract.METRICS_PATH, self.metrics_page)
        app.router.add_get(contract.MODELS_PATH, self.models)
        app.router.add_post("/tokenize", self.tokenizer)
        app.router.add_post("/detokenize", self.tokenizer)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # No per-host cap: the replicas' own queues bound the work, not the router's pool.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector)
        s = self.settings
        if self.discovery is not None:
            await self.discovery.sync(self.pool, self._session)  # the pods before the scrape
            self._discoverer = asyncio.create_task(self.discovery.run(self.pool, self._session))
        await scrape_once(self.pool, self._session, s.scrape_timeout)  # know them before serving
        self._scraper = asyncio.create_task(
            scrape_forever(self.pool, self._session, s.scrape_interval, s.scrape_timeout)
        )

    async def _stop(self, app: web.Application) -> None:
        if self.activator is not None:
            await self.activator.close()
        for task in (self._discoverer, self._scraper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()

    # --- middleware ----------------------------------------------------------------------------
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return _error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(APIError(exc.status, exc.reason or str(exc)))
        except ConnectionError:
            raise  # the client is gone: nobody to answer
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return _error_response(
                APIError(500, "internal error in the router; it logged it", code="internal_error")
            )

    # --- open endpoints --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        healthy = sum(r.healthy for r in self.pool.replicas)
        # With an activator the router takes requests at zero replicas (it holds them and
        # wakes the Deployment): it must stay in its Service, so it is healthy then too.
        status = 200 if healthy or self.activator is not None else 503
        state = "ok" if healthy else "no healthy replica"
        if not healthy and self.activator is not None:
            state = "no ready replica: the activator holds requests and scales from zero"
        body = {
            "status": state,
            "replicas": {r.url: ("ok" if r.healthy else r.error) for r in self.pool.replicas},
        }
        return web.json_response(body, status=status)

    async def metrics_page(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.exposition())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, None, None, counted=False)

    async def tokenizer(self, request: web.Request) -> web.StreamResponse:
        """/tokenize and /detokenize: every replica has the model's tokenizer, so any one
        answers (one that has the LoRA adapter `model` names, when it names one)."""
        body, _, model = await self._read_request(request)
        return await self._route(request, body, None, counted=False, model=model)

    # --- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body, parsed, model = await self._read_request(request)
        block = self.pool.block_size
        key = prefix_key(parsed, chat, self.settings.prefix_blocks * block, block)
        return await self._route(request, body, key, model=model)

    async def _read_request(self, request: web.Request) -> tuple[bytes, object, str | None]:
        """The body as sent (relayed unchanged), its JSON (None if it is not JSON: the replica
        answers that with the precise 400) and the `model` it names."""
        body = await self._read_body(request)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        model = parsed.get("model") if isinstance(parsed, dict) else None
        return body, parsed, model if isinstance(model, str) else None

    async def _route(
        self,
        request: web.Request,
        body: bytes | None,
        key: bytes | None,
        counted: bool = True,
        model: str | None = None,
    ) -> web.StreamResponse:
        """Relay the request to a replica picked for `key` (and `model`, which may name a LoRA
        adapter only some replicas have), trying others as forward.py allows; only generation
        requests (`counted`) count in the pick metrics."""
        tried: set[str] = set()
        failure: UpstreamFailed | None = None
        for attempt in range(self.settings.max_attempts):
            if attempt == 0 and not self.pool.any_healthy():
                if self.activator is not None:  # held, bounded; 503 when over
                    await self.activator.hold(self._http())
                else:
                    await self.pool.wait_for_healthy(self.settings.wait_for_replica)
            table = self.pool.placement
            placement = None
            if table is not None and key is not None:
                placement = Placement(table.owner(key), table.key_counts())
            pick = pick_replica(
                self.pool.views(),
                key,
                self.settings.policy,
                exclude=tried,
                rng=self._rng,
                placement=placement,
                model=model,
            )
            if pick is None:
                break
            if table is not None and key is not None:
                if pick.place:
                    table.assign(key, pick.name)
                else:
                    table.touch(key)
            if attempt > 0:
                self.metrics.retries.inc()
            elif counted:
                self.metrics.picks.labels(pick.reason).inc()
            self.metrics.upstream_requests.labels(pick.name).inc()
            with self.pool.track(pick.name):
                try:
                    return await forward(
                        request,
                        self._http(),
                        pick.name,
                        body,
                        self._timeout,
                        on_stream_error=functools.partial(self._stream_failed, pick.name),
                    )
                except UpstreamFailed as exc:
                    self.metrics.upstream_errors.labels(pick.name, exc.kind).inc()
                    if exc.kind == "connect":
                        self.pool.mark_down(pick.name, str(exc))
                    tried.add(pick.name)
                    failure = exc
                    if not exc.retryable:
                        break
        if failure is not None:
            return failure.answer
        self.metrics.no_replica.inc()
        raise APIError(
            503,
            f"no healthy replica among {len(self.pool.replicas)}; retry after {RETRY_AFTER_S} s",
            code="no_replica",
        )

    def _stream_failed(self, upstream: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(upstream, "stream").inc()
        log.warning("upstream %s failed mid-stream: %s", upstream, reason)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = APIError(
            413,
            f"body: exceeds the limit of {limit} bytes (--max-body-bytes)",
            code="body_too_large",
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise too_large from exc
        if len(body) > limit:
            raise too_large
        return body

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's app has not started"
        return self._session


def _error_response(exc: APIError) -> web.Response:
    headers = None
    if exc.status == 503:
        cold = exc.code in ("activator_queue_full", "cold_start_timeout")
        headers = {"Retry-After": str(act.RETRY_AFTER_S if cold else RETRY_AFTER_S)}
    return web.json_response(exc.body(), status=exc.status, headers=headers)

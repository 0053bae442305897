"""Scale from zero: the router's activator holds requests while no replica is ready, scales the
Deployment from 0 to 1 through its scale subresource, and lets them through once one is.

How it fits with the operator's autoscaler (docs/scaling.md, "Scale to zero"):
- The activator only ever moves the Deployment's replicas from 0 to 1: it reads the Scale,
  and writes `spec.replicas: 1` only when it read 0, preconditioned on that read's
  resourceVersion (a 409 means someone else scaled meanwhile: it reads again). Everything
  above 1, and going back to 0, stays the autoscaler's.
- The autoscaler counts its idle period from that scale-up (operator/idle.py: a Deployment
  that went up from 0 is activity), so the replica started for a request is not removed under
  it. The autoscaler's own scale writes are preconditioned on the count it read, so the two
  never overwrite each other blindly.
- Field ownership: the activator's write is an Update by field manager `kvfleet-activator`,
  which takes spec.replicas over; the operator's next reconcile hands it back to the
  autoscaler's manager without forcing (operator/apply.py), at the same value.

The hold is bounded: at most `queue_limit` requests wait at a time (more get 503 at once) and
each waits at most `timeout` seconds (then 503); both answers carry Retry-After and an OpenAI
error with a `code` a client can act on. The decisions are the pure functions below; the
`Activator` does the I/O.

The Kubernetes API is spoken with plain aiohttp (the runtime never imports the `kubernetes`
package), with the same in-cluster location, service-account token and CA as discovery.py.
The router's ServiceAccount needs `get` and `patch` on `deployments/scale` in its namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
from kvfleet.runtime.router.discovery import SERVICE_ACCOUNT_DIR, api_server_url
from kvfleet.runtime.router.replica_pool import ReplicaPool
from kvfleet.runtime.router.scraper import scrape_once
from kvfleet.runtime.server.api_error import APIError

log = logging.getLogger(__name__)

FIELD_MANAGER = "kvfleet-activator"
# How often the activator looks at the Deployment again while requests are held: a scale to 0
# racing the first write, or a failed write, is retried at this pace.
RECHECK_S = 1.0
# While requests are held, replicas the discovery found are scraped this often instead of at
# the scrape interval: a new pod takes requests as soon as its /health says so.
FAST_SCRAPE_S = 0.2
SCRAPE_TIMEOUT_S = 2.0
# Seconds a refused client is told to wait.
RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class ActivatorSettings:
    """Which Deployment to wake, where the API server is, and the bounds of the hold."""

    deployment: str
    namespace: str
    queue_limit: int = 100  # requests held at a time; more are refused at once
    timeout: float = 300.0  # seconds one request is held at most
    api_server: str | None = None  # None: in cluster (discovery.api_server_url)
    token_file: Path | None = SERVICE_ACCOUNT_DIR / "token"
    ca_file: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt"


# --- the decisions (pure) -------------------------------------------------------------------

Verdict = Literal["forward", "hold", "refuse"]


def admit(any_ready: bool, held: int, queue_limit: int) -> Verdict:
    """What to do with a request arriving now: forward it (a replica is ready), hold it (room
    in the queue), or refuse it (the queue is full)."""
    if any_ready:
        return "forward"
    return "hold" if held < queue_limit else "refuse"


def scale_up_patch(scale: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch for the Deployment's Scale that moves it from 0 to 1, preconditioned on
    the resourceVersion read; None when it is not at 0 (someone else scaled it: the activator
    never changes a count above 0)."""
    replicas = (scale.get("spec") or {}).get("replicas") or 0
    if replicas != 0:
        return None
    version = (scale.get("metadata") or {}).get("resourceVersion")
    patch: dict[str, Any] = {"spec": {"replicas": 1}}
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


def queue_full_error(limit: int) -> APIError:
    return APIError(
        503,
        f"the service is scaled to zero and starting; {limit} requests are already waiting "
        f"(--activator-queue-limit); retry after {RETRY_AFTER_S} s",
        code="activator_queue_full",
    )


def timeout_error(timeout: float, problem: str) -> APIError:
    why = f" ({problem})" if problem else ""
    return APIError(
        503,
        f"no replica became ready within {timeout:g} s of this request "
        f"(--cold-start-timeout){why}; retry after {RETRY_AFTER_S} s",
        code="cold_start_timeout",
    )


# --- the I/O ----------------------------------------------------------------------------------


class ScaleError(Exception):
    """The Deployment's Scale could not be read or written (RBAC, missing, unreachable)."""


class ScaleClient:
    """GET and merge-PATCH of one Deployment's scale subresource."""

    def __init__(self, settings: ActivatorSettings) -> None:
        self.settings = settings
        self._ssl: ssl.SSLContext | None = None

    def url(self) -> str:
        s = self.settings
        base = api_server_url(s)  # type: ignore[arg-type]  # needs only .api_server
        ns, name = quote(s.namespace, safe=""), quote(s.deployment, safe="")
        return f"{base}/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"

    def _headers(self) -> dict[str, str]:
        token = self.settings.token_file
        if token is not None and token.is_file():  # re-read each time: bound tokens rotate
            return {"Authorization": f"Bearer {token.read_text().strip()}"}
        return {}

    def _ssl_context(self, url: str) -> ssl.SSLContext | None:
        ca = self.settings.ca_file
        if url.startswith("https:") and self._ssl is None and ca is not None and ca.is_file():
            self._ssl = ssl.create_default_context(cafile=str(ca))
        return self._ssl

    async def _call(
        self, session: aiohttp.ClientSession, method: str, body: Any = None
    ) -> tuple[int, dict[str, Any]]:
        url = self.url()
        headers = self._headers()
        params = None
        if method == "PATCH":
            headers["Content-Type"] = "application/merge-patch+json"
            params = {"fieldManager": FIELD_MANAGER}
        try:
            async with session.request(
                method,
                url,
                json=body,
                params=params,
                headers=headers,
                ssl=self._ssl_context(url),
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp:
                answer = await resp.json(content_type=None)
                return resp.status, answer if isinstance(answer, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ScaleError(f"{method} {url}: {exc!r}") from exc

    async def scale_from_zero(self, session: aiohttp.ClientSession) -> bool:
        """Move the Deployment from 0 to 1 replica; True if this call did, False if it was not
        at 0. Retries a lost race (409) a few times; ScaleError when the API refuses."""
        for _ in range(3):
            status, scale = await self._call(session, "GET")
            if status != 200:
                detail = scale.get("message", "")
                raise ScaleError(f"reading the scale of {self.name()}: HTTP {status}: {detail}")
            patch = scale_up_patch(scale)
            if patch is None:
                return False
            status, answer = await self._call(session, "PATCH", patch)
            if status == 200:
                return True
            if status != 409:
                detail = answer.get("message", "")
                raise ScaleError(f"scaling {self.name()} to 1: HTTP {status}: {detail}")
        return False  # changed under every attempt: someone else is scaling it

    def name(self) -> str:
        return f"deployment {self.settings.namespace}/{self.settings.deployment}"


class Activator:
    """Holds requests while no replica is ready and wakes the Deployment (see the module
    docstring). One per router; single event loop, so plain counters."""

    def __init__(
        self,
        pool: ReplicaPool,
        settings: ActivatorSettings,
        metrics: Any,  # RouterMetrics (its cold_starts, cold_start_seconds, held, refused)
        client: ScaleClient | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.client = client or ScaleClient(settings)
        self.held = 0
        self.problem = ""  # the last scale error, told to clients that time out
        self.last_cold_start: float | None = None  # seconds, for logs and tests
        self._waker: asyncio.Task[None] | None = None

    async def hold(self, session: aiohttp.ClientSession) -> None:
        """Return once a replica is ready; APIError 503 when the queue is full or the wait
        exceeds the timeout."""
        verdict = admit(self.pool.any_healthy(), self.held, self.settings.queue_limit)
        if verdict == "forward":
            return
        if verdict == "refuse":
            self.metrics.activator_refused.labels("queue_full").inc()
            raise queue_full_error(self.settings.queue_limit)
        self.held += 1
        self.metrics.held.set(self.held)
        try:
            if self._waker is None or self._waker.done():
                self._waker = asyncio.create_task(self._wake_logged(session))
            if not await self.pool.wait_for_healthy(self.settings.timeout):
                self.metrics.activator_refused.labels("timeout").inc()
                raise timeout_error(self.settings.timeout, self.problem)
        finally:
            self.held -= 1
            self.metrics.held.set(self.held)

    async def close(self) -> None:
        """Stop a cold start in progress (the router is stopping)."""
        if self._waker is not None and not self._waker.done():
            self._waker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._waker

    async def _wake_logged(self, session: aiohttp.ClientSession) -> None:
        try:
            await self._wake(session)
        except Exception:  # a bug here must not go unseen; the next held request retries
            log.exception("the activator's scale from zero failed")

    async def _wake(self, session: aiohttp.ClientSession) -> None:
        """One cold start: scale from zero (again each RECHECK_S while requests are held and
        nothing is ready), scrape the known replicas often, and time the wait for the first
        ready one."""
        started = time.monotonic()
        scaled = False
        checked = -RECHECK_S
        while not self.pool.any_healthy() and self.held > 0:
            if time.monotonic() - checked >= RECHECK_S:
                checked = time.monotonic()
                scaled = await self._scale_from_zero(session) or scaled
            if self.pool.replicas:
                await scrape_once(self.pool, session, SCRAPE_TIMEOUT_S)
            await self.pool.wait_for_healthy(FAST_SCRAPE_S)
        if self.pool.any_healthy():
            seconds = time.monotonic() - started
            self.metrics.cold_start_seconds.observe(seconds)
            self.last_cold_start = seconds
            log.info(
                "a replica is ready %.1f s after the first held request%s",
                seconds,
                "" if scaled else " (scaled up by someone else)",
            )

    async def _scale_from_zero(self, session: aiohttp.ClientSession) -> bool:
        try:
            scaled = await self.client.scale_from_zero(session)
        except ScaleError as exc:
            if str(exc) != self.problem:
                log.error("cannot scale from zero: %s", exc)
            self.problem = str(exc)
            return False
        self.problem = ""
        if scaled:
            self.metrics.cold_starts.inc()
            log.info("scaled %s from 0 to 1 for a held request", self.client.name())
        return scaled

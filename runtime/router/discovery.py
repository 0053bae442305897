"""Finding the replicas in Kubernetes: the Ready pods that match a label selector, listed from
the API server about once a second and handed to `ReplicaPool.set_upstreams()`.

Plain aiohttp against the REST API (the runtime never imports the `kubernetes` package): in a
pod, the API server is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, trusted
through the service account's CA, with the service account's token (re-read at every poll:
bound tokens are rotated by the kubelet). `api_server` replaces that location (tests, or a
router outside the cluster with `kubectl proxy`).

Pods, not EndpointSlices: a pod's Ready condition is what the kubelet's readiness probe on
/health set, the same signal the router's own scrape reads, and listing pods needs one Role
rule (list pods) in one namespace.

Interface (also for the scale-from-zero activator): `PodDiscovery(settings).poll(session)`
returns the replica URLs now; `run(pool, session)` keeps `pool` in step until cancelled and
calls `on_change(urls)` after each change.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from kvfleet.runtime.router.replica_pool import ReplicaPool

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class DiscoveryError(Exception):
    """The pods could not be listed (no API server configured, HTTP error, bad answer)."""


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """Which pods are replicas and where the API server is; validated by `kvfleet router`."""

    selector: str  # a label selector, e.g. app.kubernetes.io/instance=chat
    namespace: str
    port: int  # the replicas' port (every pod serves on the same one)
    api_server: str | None = None  # None: in cluster, from KUBERNETES_SERVICE_HOST/PORT
    token_file: Path | None = SERVICE_ACCOUNT_DIR / "token"  # None or missing: no token
    ca_file: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt"  # None or missing: system CAs
    interval: float = 1.0  # seconds between polls
    timeout: float = 5.0  # seconds one poll may take


def api_server_url(settings: DiscoverySettings, env: Mapping[str, str] = os.environ) -> str:
    """The API server's base URL: `settings.api_server`, else the in-cluster one."""
    if settings.api_server:
        return settings.api_server.rstrip("/")
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise DiscoveryError(
            "discover-api-server: not given, and KUBERNETES_SERVICE_HOST/PORT are not set "
            "(not in a pod): pass --discover-api-server URL"
        )
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}"


def replica_url(ip: str, port: int) -> str:
    """http://IP:PORT, bracketing an IPv6 address."""
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, an IP, and not being deleted (a terminating pod drains)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def ready_replica_urls(pod_list: Mapping[str, Any], port: int) -> list[str]:
    """The base URLs of the Ready pods of a PodList, sorted (stable for logs and tests)."""
    items = pod_list.get("items")
    if not isinstance(items, list):
        raise DiscoveryError("the API server's pod list has no items")
    return sorted({replica_url(p["status"]["podIP"], port) for p in items if pod_is_ready(p)})


class PodDiscovery:
    """Lists the selected pods; `run` keeps a ReplicaPool in step with them."""

    def __init__(
        self,
        settings: DiscoverySettings,
        on_change: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_change = on_change
        self.last_error: str = ""
        self._ssl: ssl.SSLContext | None = None

    def _url(self) -> str:
        s = self.settings
        base = api_server_url(s)
        return f"{base}/api/v1/namespaces/{quote(s.namespace, safe='')}/pods"

    def _ssl_context(self) -> ssl.SSLContext | None:
        ca = self.settings.ca_file
        if self._ssl is None and ca is not None and ca.is_file():
            self._ssl = ssl.create_default_context(cafile=str(ca))
        return self._ssl

    def _headers(self) -> dict[str, str]:
        token_file = self.settings.token_file
        if token_file is not None and token_file.is_file():
            return {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        return {}

    async def poll(self, session: aiohttp.ClientSession) -> list[str]:
        """The replica URLs now; DiscoveryError when the API server cannot say."""
        url = self._url()
        limit = aiohttp.ClientTimeout(total=self.settings.timeout)
        params = {"labelSelector": self.settings.selector}
        try:
            async with session.get(
                url,
                params=params,
                headers=self._headers(),
                ssl=self._ssl_context() if url.startswith("https:") else None,
                timeout=limit,
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise DiscoveryError(f"listing pods: HTTP {resp.status}: {text}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise DiscoveryError(f"listing pods at {url}: {exc!r}") from exc
        return ready_replica_urls(body, self.settings.port)

    async def sync(self, pool: ReplicaPool, session: aiohttp.ClientSession) -> bool:
        """One poll into `pool`; False (and the pool kept as it was) when it failed."""
        try:
            urls = await self.poll(session)
        except DiscoveryError as exc:
            if str(exc) != self.last_error:  # log a failure once, not every second
                log.warning("replica discovery: %s (keeping the %d known)", exc, len(pool.replicas))
            self.last_error = str(exc)
            return False
        if self.last_error:
            log.info("replica discovery works again")
            self.last_error = ""
        if urls != sorted(r.url for r in pool.replicas):
            log.info("replicas: %s", ", ".join(urls) or "none")
            pool.set_upstreams(urls)
            if self.on_change is not None:
                self.on_change(urls)
        return True

    async def run(self, pool: ReplicaPool, session: aiohttp.ClientSession) -> None:
        """Poll every `interval` seconds until cancelled. An API server that cannot be reached
        keeps the last known replicas: the ones serving are still there."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            try:
                await self.sync(pool, session)
            except Exception:  # a bug here must not freeze the replica set for good
                log.exception("replica discovery failed")
            await asyncio.sleep(max(0.0, self.settings.interval - (loop.time() - start)))

"""Reading every replica's /health and /metrics about once a second, into the ReplicaPool.

/health says whether a replica takes requests (503 while loading or draining); /metrics gives
its load and the LoRA adapters it has loaded, through the parser the operator's autoscaler uses
(kvfleet/runtime_load.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from kvfleet.runtime.router.replica_pool import ReplicaPool

from kvfleet.contract import HEALTH_PATH, METRICS_PATH
from kvfleet.runtime_load import MetricsParseError, parse_runtime_metrics

log = logging.getLogger(__name__)


async def scrape_once(pool: ReplicaPool, session: aiohttp.ClientSession, timeout: float) -> None:
    """Scrape every replica concurrently, each within `timeout` seconds."""
    await asyncio.gather(*(_scrape(pool, r.url, session, timeout) for r in pool.replicas))


async def scrape_forever(
    pool: ReplicaPool, session: aiohttp.ClientSession, interval: float, timeout: float
) -> None:
    """Scrape every `interval` seconds until cancelled; a tick never overlaps the next."""
    while True:
        start = time.monotonic()
        try:
            await scrape_once(pool, session, timeout)
        except Exception:  # a bug here must not freeze every replica's state for good
            log.exception("scraping the replicas failed")
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))


async def _scrape(
    pool: ReplicaPool, url: str, session: aiohttp.ClientSession, timeout: float
) -> None:
    was_healthy = (r := pool.get(url)) is not None and r.healthy
    limit = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(url + HEALTH_PATH, timeout=limit) as resp:
            health = resp.status
            await resp.read()
        if health != 200:
            pool.record_scrape(url, healthy=False, error=f"/health: HTTP {health}", definite=True)
            return
        async with session.get(url + METRICS_PATH, timeout=limit) as resp:
            if resp.status != 200:
                pool.record_scrape(
                    url, healthy=False, error=f"/metrics: HTTP {resp.status}", definite=True
                )
                return
            load = parse_runtime_metrics(await resp.text())
    except aiohttp.ClientConnectorError as exc:  # refused, unresolvable: nothing listens
        pool.record_scrape(url, healthy=False, error=str(exc), definite=True)
    except TimeoutError:
        pool.record_scrape(url, healthy=False, error=f"no answer within {timeout:g} s")
    except (aiohttp.ClientError, MetricsParseError, UnicodeDecodeError) as exc:
        pool.record_scrape(url, healthy=False, error=f"{type(exc).__name__}: {exc}")
    else:
        pool.record_scrape(
            url,
            healthy=True,
            waiting=load.waiting,
            running=load.running,
            kv_usage=load.kv_usage,
            block_size=load.block_size,
            adapters=load.adapters,
        )
    finally:
        r = pool.get(url)
        if r is not None and r.healthy != was_healthy:
            if r.healthy:
                log.info("replica %s is up", url)
            else:
                log.warning("replica %s is down: %s", url, r.error)

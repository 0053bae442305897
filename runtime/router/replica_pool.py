"""The replicas the router knows, their last scraped state, and its own in-flight counts.

The set of replicas can change while serving (`set_upstreams`): the `--upstream` list, or the
Ready pods that Kubernetes discovery lists (discovery.py); an activator that scales a
Deployment up from zero and waits for its first ready pod (`wait_for_healthy`) can drive it
the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvfleet.runtime.router.placement import PlacementTable
from kvfleet.runtime.router.policy import ReplicaView

DEFAULT_BLOCK_SIZE = 16  # the runtime's and vLLM's default, until a replica says otherwise
# Scrapes that must fail in a row (no answer, timeout) before a replica is taken out: one slow
# scrape on a busy host is not an outage. A refused connection or a 503 from /health counts at
# once: those are answers.
FAILED_SCRAPES_TO_DOWN = 2


@dataclass(slots=True)
class Replica:
    """One upstream: its URL (also its name and its identity for hashing) and what is known."""

    url: str
    healthy: bool = False  # until the first scrape says otherwise
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded, from its last scrape
    in_flight: int = 0
    failed_scrapes: int = 0
    error: str = "not scraped yet"

    def view(self) -> ReplicaView:
        return ReplicaView(
            self.url,
            self.healthy,
            self.waiting,
            self.running,
            self.kv_usage,
            self.in_flight,
            self.adapters,
        )


class ReplicaPool:
    """Replicas by URL. Single event loop: no locks, every change happens between awaits."""

    def __init__(self, urls: Iterable[str], placement: PlacementTable | None = None) -> None:
        self._replicas: dict[str, Replica] = {}
        self._healthy = asyncio.Event()
        # Which replica each prefix key was placed on (None: rendezvous hashing alone).
        self.placement = placement
        self.set_upstreams(urls)

    def set_upstreams(self, urls: Iterable[str]) -> None:
        """Replace the set of replicas, keeping what is known of those that stay; the keys
        placed on one that left are forgotten (placed afresh on their next request)."""
        wanted = [u.rstrip("/") for u in urls]
        self._replicas = {u: self._replicas.get(u) or Replica(u) for u in wanted}
        if self.placement is not None:
            self.placement.retain(self._replicas)
        self._update_event()

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def views(self) -> list[ReplicaView]:
        return [r.view() for r in self._replicas.values()]

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the smallest any replica reports (a shorter prefix is never
        cached anywhere), the runtime's default until one does."""
        sizes = [r.block_size for r in self._replicas.values() if r.block_size]
        return min(sizes) if sizes else DEFAULT_BLOCK_SIZE

    def record_scrape(
        self,
        url: str,
        *,
        healthy: bool,
        waiting: float = 0.0,
        running: float = 0.0,
        kv_usage: float = 0.0,
        block_size: int | None = None,
        adapters: frozenset[str] = frozenset(),
        error: str = "",
        definite: bool = False,
    ) -> None:
        """Store a scrape's result. A failure (`healthy` False) takes the replica out at once
        when `definite` (an answer said so), else after FAILED_SCRAPES_TO_DOWN in a row."""
        r = self._replicas.get(url)
        if r is None:  # removed while its scrape was under way
            return
        if healthy:
            r.healthy, r.failed_scrapes, r.error = True, 0, ""
            r.waiting, r.running, r.kv_usage = waiting, running, kv_usage
            r.block_size = block_size or r.block_size
            r.adapters = adapters
        else:
            r.failed_scrapes += 1
            r.error = error
            if definite or r.failed_scrapes >= FAILED_SCRAPES_TO_DOWN:
                r.healthy = False
        self._update_event()

    def mark_down(self, url: str, error: str) -> None:
        """Take a replica out until a scrape finds it healthy again (a refused connection)."""
        r = self._replicas.get(url)
        if r is not None:
            r.healthy, r.error = False, error
            self._update_event()

    @contextlib.contextmanager
    def track(self, url: str) -> Iterator[None]:
        """Count a request as in flight on `url` for as long as the block runs."""
        r = self._replicas.get(url)
        if r is not None:
            r.in_flight += 1
        try:
            yield
        finally:
            if r is not None:
                r.in_flight -= 1

    def any_healthy(self) -> bool:
        return self._healthy.is_set()

    async def wait_for_healthy(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for some replica to be healthy (where an activator
        holds a request while a scaled-to-zero service comes up); False if none came."""
        if timeout <= 0:
            return self.any_healthy()
        try:
            await asyncio.wait_for(self._healthy.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _update_event(self) -> None:
        if any(r.healthy for r in self._replicas.values()):
            self._healthy.set()
        else:
            self._healthy.clear()

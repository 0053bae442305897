"""The router's settings, in a module of their own so that `kvfleet --help` can show their
defaults without importing aiohttp."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.router.placement import DEFAULT_MAX_KEYS
from kvfleet.runtime.router.policy import PolicySettings


@dataclass(slots=True)
class RouterSettings:
    """The router's knobs; validated by `kvfleet router` (cmd_router.py)."""

    policy: PolicySettings = field(default_factory=PolicySettings)
    prefix_blocks: int = 4  # KV blocks of the prompt that make its key
    placement_table_size: int = DEFAULT_MAX_KEYS  # prefix keys remembered (LRU); 0: hashing only
    scrape_interval: float = 1.0
    scrape_timeout: float = 2.0
    connect_timeout: float = 5.0
    request_timeout: float = 600.0  # a whole request, stream included
    wait_for_replica: float = 5.0
    max_attempts: int = 3
    max_body_bytes: int = 1024 * 1024  # kvfleet serve's default limit: larger ones it refuses
    seed: int | None = None  # for the random policy (benchmarks)
    api_key: str | None = None  # required of every client, as the replicas do (api_key.py)

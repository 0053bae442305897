"""Rendezvous (highest-random-weight) hashing: every replica scores a key, the highest wins.

Why this and not a ring: no virtual nodes to tune, and when a replica leaves only the keys it
won move (each to its own runner-up); when one joins it takes about 1/N of the keys, from
every other replica alike. The ranking is a pure function of the key and the names, so two
routers (or a restarted one) agree without sharing any state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(key: bytes, name: str) -> int:
    """The replica's weight for this key (64 bits of BLAKE2b: stable across processes,
    unlike Python's salted hash())."""
    digest = hashlib.blake2b(name.encode() + b"\x00" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: bytes, names: Iterable[str]) -> list[str]:
    """The replicas in the order this key prefers them (ties broken by name)."""
    return sorted(names, key=lambda n: (-score(key, n), n))

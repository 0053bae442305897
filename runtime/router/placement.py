"""Which replica each prefix key was placed on: the router's approximate index of what each
replica's prefix cache holds (GIE's prefix-cache scorer and SGLang's router keep one too).

Hashing alone places a handful of keys badly: 8 system prompts over 3 replicas by rendezvous
hashing came out 4/3/1 or 5/2/1, and the replica with half the traffic ran out of KV memory
(docs/scaling.md, Measured). With this table the policy places a *new* key on the replica with
the fewest keys (policy.py) and sends it back there afterwards, so 8 keys land 3/3/2.

Bounded: the least recently used key is forgotten past `max_keys` (its prompt is likely gone
from the replica's cache by then too). A replica that leaves the set takes its keys with it:
they are placed afresh, one by one, on the replicas with the fewest keys. Single event loop,
no locks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping

DEFAULT_MAX_KEYS = 65536  # 8-byte keys + names: a few MB at most


class PlacementTable:
    """key -> replica name, least recently used first, with a count of keys per replica."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: bytes) -> str | None:
        """The replica the key was placed on (None: a new key); does not refresh it."""
        return self._owner.get(key)

    def key_counts(self) -> Mapping[str, int]:
        """Keys placed on each replica (replicas with none are absent)."""
        return self._counts

    def assign(self, key: bytes, name: str) -> None:
        """Place `key` on `name` (again, or anew), most recently used; evict past max_keys."""
        old = self._owner.pop(key, None)
        if old is not None:
            self._release(old)
        self._owner[key] = name
        self._counts[name] += 1
        while len(self._owner) > self.max_keys:
            _, evicted = self._owner.popitem(last=False)
            self._release(evicted)

    def touch(self, key: bytes) -> None:
        """Mark a key used now (a request went to its replica), so it is evicted last."""
        if key in self._owner:
            self._owner.move_to_end(key)

    def retain(self, names: Iterable[str]) -> int:
        """Forget every key placed on a replica not in `names` (it left the set); how many."""
        keep = set(names)
        gone = [k for k, n in self._owner.items() if n not in keep]
        for k in gone:
            self._release(self._owner.pop(k))
        return len(gone)

    def _release(self, name: str) -> None:
        self._counts[name] -= 1
        if self._counts[name] <= 0:
            del self._counts[name]

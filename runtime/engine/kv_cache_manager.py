"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block tables,
reference counts, and automatic prefix caching.

Pure Python, no tensors: it decides which physical block holds which tokens; the model runner
turns that into slot mappings and block tables. A full block is named by a hash of its tokens
chained with its parent block's hash, so a block means the same thing wherever it appears.
Freed blocks keep that name in an LRU queue and are reused on a hit, evicted only when a fresh
block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvfleet.runtime.engine.request import Request

_ROOT_HASH = b"kvfleet-prefix-root"


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    """Collision-resistant id of a full block: a hit must never serve another prompt's KV."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_hash(lora_id: int) -> bytes:
    """The parent of a request's first block: the same tokens under another LoRA adapter
    (which changes every layer's K and V) are another chain, never a hit."""
    return _ROOT_HASH if lora_id == 0 else hash_block(_ROOT_HASH, [lora_id])


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    """Owns the block pool. All methods are O(blocks touched), none scans the pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order (front = evict first). Cached-but-free blocks stay here
        # with their hash until a fresh block is needed.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash → physical block
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_hashed: dict[str, int] = {}  # leading blocks of a request already named
        self.stats = PrefixCacheStats()

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # --- prefix lookup -----------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Name every full block among the request's first `num_tokens` tokens (incrementally)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(request.lora_id)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of the request's leading full blocks already in the cache, and the
        number of tokens they hold. At least one token is always left to compute, because the
        step that computes it produces the next token's logits. Counted in `stats` only when
        the request is admitted with them (allocate_slots)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_tokens = request.num_known_tokens - 1
        owed = request.prompt_logprob_position
        if owed is not None:
            # Logits exist only for computed positions: a hit past the first position that
            # still owes a prompt logprob would skip it (after a preemption the positions
            # already collected may hit).
            max_hit_tokens = min(max_hit_tokens, owed)
        self._extend_hashes(request, max_hit_tokens)
        blocks: list[int] = []
        for h in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # --- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        Returns False, changing nothing, when the pool cannot supply the blocks; the scheduler
        then preempts or waits. `computed_blocks` (prefix hits) are taken on admission."""
        rid = request.request_id
        held = self.req_blocks.get(rid)
        computed_blocks = computed_blocks or []
        num_held = (len(held) if held else 0) + len(computed_blocks)
        total_tokens = request.num_computed_tokens + num_new_tokens
        if held is None:
            total_tokens += len(computed_blocks) * self.block_size
        needed = -(-total_tokens // self.block_size) - num_held
        # Hit blocks that are free right now leave the free queue when taken.
        reclaimed = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if needed > len(self.free_queue) - reclaimed:
            return False
        if held is None:
            held = self.req_blocks[rid] = []
            self.req_num_hashed[rid] = 0
            if self.enable_prefix_caching:
                # Admission: the lookup counts now, once. A request the pool turned away is
                # looked up again at every step it waits, and counting those lookups made a
                # full cache's hit rate a measure of how long requests queued.
                self.stats.queries += request.num_tokens
                self.stats.hits += len(computed_blocks) * self.block_size
        for b in computed_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            held.append(b)
        self.req_num_hashed[rid] += len(computed_blocks)
        for _ in range(max(needed, 0)):
            held.append(self._take_fresh_block())
        if self.enable_prefix_caching:
            # Only the request's own known tokens name blocks: slots made for draft tokens
            # (speculative decoding) hold nothing the cache may serve until they are accepted,
            # and a placeholder (async scheduling) waits for its token, named at the next call.
            self._name_full_blocks(request, min(total_tokens, request.num_known_tokens))
        return True

    def _take_fresh_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _name_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the blocks that `num_tokens` fills, so later requests (even ones scheduled in
        this same step: every layer writes the step's K/V before attention reads) can hit them."""
        rid = request.request_id
        blocks = self.req_blocks[rid]
        start = self.req_num_hashed[rid]
        end = min(num_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        self._extend_hashes(request, end * self.block_size)
        for i in range(start, end):
            h = request.block_hashes[i]
            b = blocks[i]
            if self.block_hash[b] is None:
                self.block_hash[b] = h
                self.cached.setdefault(h, b)
        self.req_num_hashed[rid] = end

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past those `num_tokens` tokens need: the slots of
        draft tokens the model rejected (unnamed, so they are the first to be reused)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        self._release(blocks[keep:])
        del blocks[keep:]
        hashed = self.req_num_hashed[request.request_id]
        self.req_num_hashed[request.request_id] = min(hashed, keep)

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks go to the front of the eviction queue so a
        shared prefix outlives the unique suffixes behind it."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_num_hashed.pop(rid, None)
        if blocks:
            self._release(blocks)

    def _release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    # Nothing to reuse: evict it before any cached block.
                    self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block's name (used by benchmarks to compare cold runs)."""
        for b in self.free_queue:
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None

"""Iteration-level continuous batching.

Each step gets a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests go first (a decode needs one token; a prompt being chunked needs the rest of
its prompt), then waiting requests in arrival order, admitted only when the KV cache can hold
what they need now. When blocks run out, the newest running request is preempted: its blocks
are freed and it is recomputed later (its tokens are kept, so nothing is lost).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class ScheduledBatch:
    """What one forward pass computes: for each request, its next `num_tokens` tokens."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- bookkeeping -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a request (stopped, length or aborted) and give its blocks back at once."""
        if request.finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        batch.preempted.append(request)

    # --- the decision ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                # Newest first: requests behind `request` are not scheduled yet this step.
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_tokens.append(num_new)
                budget -= num_new
                i += 1
            # When `request` itself was preempted, `i` already points at the next one.

        if not batch.preempted:
            self._admit_waiting(batch, budget)

        now = time.monotonic()
        for request in batch.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt must fit one step; try again next step
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break  # admission only when the cache has room
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_tokens.append(num_new)
            budget -= num_new

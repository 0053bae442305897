"""Iteration-level continuous batching.

Each step gets a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
A step is filled in three passes:

1. running decodes, one token each (with their draft tokens under speculative decoding, where
   the budget and the cache have room): a prompt never takes a running stream's place;
2. running requests part-way through their prompt (or a recompute), oldest first;
3. waiting requests in arrival order, admitted only when the KV cache can hold what they need
   now (head of line: a prompt the cache cannot take yet is not overtaken by a newer one).

A prompt's share of one step is at most `long_prefill_token_threshold` tokens (0: the whole
budget), so several prompts can be part-way through their prefill at once and a short prompt
that arrived behind a long one is not held back for the whole of the long one's prefill. While
requests decode, prompts together get at most the time that keeps the step within
`max_step_time_ratio` of a decode-only step, by the step times measured so far (step_time.py),
or what keeps prefill ahead of the prompt work arriving where that is more (a bound below the
arrival rate would leave requests queueing for their first token while fewer and fewer streams
decode); each prompt's chunk is what its share of that time buys where the chunk starts, fewer
tokens late in a long prompt, whose tokens attend to more context. Streams keep flowing while
long prompts arrive, and closed-loop clients lose little throughput
(tests/runtime/test_prompt_pace.py).
When blocks run out, the newest running request is preempted: its blocks are freed and it is
recomputed later, before any request that arrived after it (its tokens are kept, so nothing is
lost).

Why this order (issue 22): a request's first token then depends only on the requests that
arrived no later than it (each step the oldest unfinished prompt gets at least
min(threshold, budget - running decodes, half the step-time allowance) tokens), and an earlier
prompt that is no longer gets its first token no later than a newer one.
Tests: tests/runtime/test_scheduler_fairness.py.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from kvfleet.runtime.engine.config import EngineConfig
from kvfleet.runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet.runtime.engine.request import Request, RequestStatus
from kvfleet.runtime.engine.step_time import (
    PromptPace,
    PromptTime,
    StepTimeModel,
    context_sum,
)

# While several prompts are in line, a step's prompt time goes to a few of them in shares no
# smaller than this many tokens at a prompt's start cost (and in two at the least): prompts of
# like length then get their first tokens one after another, in order, rather than all late
# together, and one arriving behind a long prompt starts at once.
MIN_PROMPT_SHARE = 64


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    # Most prompt tokens one request computes in a step (0: up to the whole budget). Only with
    # chunked prefill: without it a prompt is computed in one step or not at all.
    long_prefill_token_threshold: int = 0
    # While requests decode, a step carrying prompt tokens may take at most this many times
    # their decode-only step (step_time.py sizes its prompt share); 0: no such bound.
    max_step_time_ratio: float = 0.0
    # The fewest prompt tokens a step may carry under that bound: prompts always progress.
    min_prompt_tokens: int = 16
    # Most LoRA adapters among running requests (the slots the model holds them in); a
    # waiting request of another adapter is passed over until one of them ends. 0: no LoRA.
    max_loras: int = 0


def scheduler_config(config: EngineConfig, max_model_len: int) -> SchedulerConfig:
    """The scheduler's settings from the engine's flags."""
    max_batched = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        # Without chunking a whole prompt must fit one step.
        max_batched = max(max_batched, max_model_len)
    return SchedulerConfig(
        config.max_num_seqs,
        max_batched,
        config.enable_chunked_prefill,
        config.long_prefill_token_threshold,
        config.max_step_time_ratio,
        min_prompt_tokens=config.block_size,
        max_loras=config.max_loras if config.enable_lora else 0,
    )


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

    def prompt_context(self) -> int:
        """The context its prompt chunks attend to, summed (step_time.context_sum): their
        attention's work. Read before the step's tokens are counted as computed."""
        return sum(
            context_sum(r.num_computed_tokens, n)
            for r, n in zip(self.requests, self.num_tokens, strict=True)
            if not r.is_decoding
        )


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # Steps' durations as the engine measures them, what the prompt allowance is sized by:
        # kept only where there is an allowance to size (chunked prefill, a ratio set).
        bounded = config.enable_chunked_prefill and config.max_step_time_ratio > 0
        self.step_times = StepTimeModel() if bounded else None
        self.pace = PromptPace() if bounded else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled
        self._prompt_time: PromptTime | None = None  # the step-time bound's, this step

    # --- bookkeeping -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.pace is not None:
            self.pace.arrive(request.num_tokens - request.num_computed_tokens)

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

    def retire(self, request: Request) -> None:
        """Take a running request whose last token is being sampled (async scheduling) out of
        the batch and give its blocks back: nothing of it runs again. `finish` ends it once
        the token is read."""
        self.running.remove(request)
        self.kv.free(request)

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
        request.spec_token_ids.clear()
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        if self.pace is not None:
            self.pace.arrive(request.num_tokens)  # its recompute
        batch.preempted.append(request)
        # A request scheduled earlier in this step (a decode, newer than the prefill that needs
        # its blocks) leaves the batch and gives its tokens back.
        for i in range(len(batch.requests) - 1, -1, -1):
            if batch.requests[i] is request:
                del batch.requests[i]
                self._budget += batch.num_tokens.pop(i)
                break

    # --- the decision ------------------------------------------------------------------------
    def _chunk_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        if cap <= 0 or not self.config.enable_chunked_prefill:
            return self.config.max_num_batched_tokens
        return cap

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # Tokens left in this step; a preemption may give some back (see _preempt).
        self._budget = self.config.max_num_batched_tokens
        cap = self._chunk_cap()
        decodes = []
        prefills = []
        for r in self.running:
            (decodes if r.is_decoding else prefills).append(r)

        for request in decodes:
            if self._budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this step
                self._schedule_decode(request, batch)
        self._bound_prompt_time(len(batch.requests), len(prefills) + len(self.waiting))
        for request in prefills:
            if self._budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:
                start = request.num_computed_tokens
                most = min(request.num_tokens - start, self._budget, cap)
                n = self._prompt_tokens(start, most)
                if most and not n:
                    break  # the prompts' time in this step is spent
                if self._schedule_running(request, n, batch):
                    self._spend(start, n)

        if not batch.preempted:
            self._admit_waiting(batch, cap)

        now = time.monotonic()
        for request in batch.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return batch

    def _bound_prompt_time(self, decode_rows: int, prompts: int) -> None:
        """With chunked prefill and requests decoding, leave prompts only the time the step
        time allows (step_time.py), or what keeps prefill ahead of the prompt work arriving
        where that is more: a long prompt then delays each stream's next token by a bounded
        factor instead of a whole prefill, and prefill keeps ahead of arrivals. The factor is
        of the decode-only step of the streams there will be — those decoding and the requests
        waiting for their first token (`prompts`, queued or part-way through their prompt) —
        not of those decoding now: sized by a batch a burst of arrivals has not filled yet, the
        prompts' time would be too short to fill it, and the batch would stay part-empty for as
        long as the burst lasts. When more requests wait than decode, the time grows by that
        factor too: the stall then falls on fewer streams than the first tokens it brings
        forward. The time is shared among the prompts in line (MIN_PROMPT_SHARE)."""
        self._prompt_time = None
        if self.step_times is None or self.pace is None:
            return
        self.pace.step()
        streams = min(decode_rows + prompts, self.config.max_num_seqs) if decode_rows else 0
        seconds = self.step_times.prompt_seconds(streams, self.config.max_step_time_ratio)
        cost = self.step_times.prompt_cost()
        if seconds is None or cost is None:
            return
        seconds = max(seconds, self.pace.seconds(cost))
        if prompts > decode_rows:
            seconds = seconds * prompts / decode_rows
        shares = max(min(prompts, max(int(seconds // cost.seconds(MIN_PROMPT_SHARE, 0)), 2)), 1)
        self._prompt_time = PromptTime(
            cost, seconds, seconds / shares, self.config.min_prompt_tokens
        )

    def _prompt_tokens(self, start: int, most: int) -> int:
        """How many of at most `most` prompt tokens from position `start` this step carries."""
        return most if self._prompt_time is None else self._prompt_time.tokens(start, most)

    def _spend(self, start: int, tokens: int) -> None:
        if self._prompt_time is not None:
            self._prompt_time.spend(start, tokens)

    def _schedule_decode(self, request: Request, batch: ScheduledBatch) -> None:
        """Its next token, and its draft tokens (speculative decoding) where the budget and
        the cache have room for them: drafts are the first thing given up, before any
        request is preempted for their slots."""
        drafts = request.spec_token_ids
        if drafts:
            del drafts[max(self._budget - 1, 0) :]
        if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
            batch.requests.append(request)
            batch.num_tokens.append(1 + len(drafts))
            self._budget -= 1 + len(drafts)
            return
        drafts.clear()
        self._schedule_running(request, 1, batch)

    def _schedule_running(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Schedule `num_new` tokens of `request`, preempting the newest requests for their
        blocks where needed; False where `request` itself was preempted."""
        while not self.kv.allocate_slots(request, num_new):
            # Newest first: the oldest requests keep their blocks.
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is request:
                return False
        batch.requests.append(request)
        batch.num_tokens.append(num_new)
        self._budget -= num_new
        return True

    def _admit_waiting(self, batch: ScheduledBatch, cap: int) -> None:
        adapters = {r.lora_id for r in self.running if r.lora_id}
        passed_over: list[Request] = []
        try:
            self._admit_in_order(batch, cap, adapters, passed_over)
        finally:
            # Still first in line, in their order, for when a slot frees.
            self.waiting.extendleft(reversed(passed_over))

    def _admit_in_order(
        self, batch: ScheduledBatch, cap: int, adapters: set[int], passed_over: list[Request]
    ) -> None:
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora = request.lora_id
            if lora and lora not in adapters and len(adapters) >= self.config.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > self._budget:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt must fit one step; try again next step
                num_new = self._budget
            num_new = self._prompt_tokens(num_hit, min(num_new, cap))
            if num_new <= 0 or not self.kv.allocate_slots(request, num_new, hit_blocks):
                break  # admission only when the step has time and the cache has room
            self._spend(num_hit, num_new)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora:
                adapters.add(lora)
            batch.requests.append(request)
            batch.num_tokens.append(num_new)
            self._budget -= num_new

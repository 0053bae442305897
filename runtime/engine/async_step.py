"""Async scheduling (--async-scheduling): the core schedules and launches step N+1 before the
tokens step N sampled reach the host, so that on a GPU the host's work for a step (scheduling,
building inputs, reading tokens, stop checks, outputs) overlaps the device's.

A sequence that step N samples for carries a placeholder for that token (`Request.pending_row`:
the row of N's tokens that holds it). The scheduler counts it as a token, the KV cache gives it a
slot (and names no block with it), and the model runner takes its input id from N's tokens where
they are, on the device. Once N+1 is launched, the host reads N's tokens (copied to pinned memory
as soon as sampled, so it waits for that copy, not for N+1), puts each in place of its
placeholder and runs the stop checks as a synchronous step would, before N+1 samples (so
penalties, grammars and min_tokens see every token before it). Outputs come one call later.

What it costs: a sequence that ended at N (EOS, a stop token, a stop string the server found, an
abort) ran one row of N+1 for nothing, whose token is dropped. One whose token at N is its last
(max_tokens, the context's end) is known as such: it leaves the batch at once, its blocks freed,
and ends when the token is read. On CPU the forward pass runs in the calling thread, so nothing
overlaps; each sequence's tokens are those of synchronous steps either way. Speculative decoding
and tensor parallelism need each step's tokens on the host before the next is built, and refuse
the flag (config.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.engine.request import Request
from kvfleet.runtime.engine.sampler import sample_isolated
from kvfleet.runtime.engine.token_logprob import TokenLogprob
from kvfleet.runtime.engine.transfers import DeferredTokens, to_device

if TYPE_CHECKING:
    from kvfleet.runtime.engine.core import EngineCore
    from kvfleet.runtime.engine.core_messages import SequenceOutput
    from kvfleet.runtime.engine.model_runner import StepLogits
    from kvfleet.runtime.engine.scheduler import ScheduledBatch
    from kvfleet.runtime.engine.speculator import Pick

log = logging.getLogger(__name__)

# What a sequence's last token reads until its step's tokens reach the host. Never a model's
# input: the model runner puts the sampled token there first.
PLACEHOLDER = -1


@dataclass(slots=True)
class InFlight:
    """A step whose sampled tokens the host has not read yet."""

    rows: list[Request]  # the sequences sampled for, in row order
    tokens: DeferredTokens
    logprobs: list[TokenLogprob | None]
    # Where sampling the batch failed, each row's pick or exception, sampled one by one.
    picks: list[Pick | Exception] | None = None

    def read(self) -> list[Pick | Exception]:
        if self.picks is not None:
            return self.picks
        return list(zip(self.tokens.tolist(), self.logprobs, strict=True))


class AsyncSteps:
    """The core's step under async scheduling: one step in flight at a time."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.in_flight: InFlight | None = None

    def step(self, batch: ScheduledBatch) -> list[SequenceOutput]:
        """Launch `batch` (scheduled with the step in flight's placeholders), then read the step
        in flight and hand back what it brought; `batch` is then the one in flight."""
        core = self.core
        previous, self.in_flight = self.in_flight, None
        if batch:
            started = time.perf_counter()
            result, context = core.launch(batch, previous.tokens if previous else None)
        outputs = self._read(previous) if previous is not None else []
        if batch:
            self.in_flight = self._sample(result)
            # On a GPU the time from here to there is one step's period, most of it the wait
            # for N: the step-time model sees each shape one step late, which only matters
            # where the shape changes.
            core.observe(batch, result, context, started)
        return outputs

    def _read(self, flight: InFlight) -> list[SequenceOutput]:
        """Put the tokens of `flight` in place of their placeholders, as a synchronous step
        appends them (grammar, stop checks, counters); the outputs of the sequences they are for."""
        core = self.core
        now = time.monotonic()
        touched: list[Request] = []
        failed: list[SequenceOutput] = []
        for r, pick in zip(flight.rows, flight.read(), strict=True):
            if r.finished or r.pending_row < 0:
                continue  # it ended while the step ran: its row computed nothing it needs
            r.pending_row = -1
            r.all_token_ids.pop()  # the placeholder; `take` appends the token
            failed.extend(core.take(r, pick, now))
            touched.append(r)
        return core.outputs(touched) + failed

    def _sample(self, result: StepLogits) -> InFlight | None:
        """Sample the launched step's rows without waiting for it (but for logprobs), and give
        each sequence still running its placeholder."""
        core = self.core
        live = [i for i, r in enumerate(result.sample_rows) if not r.finished]
        if not live:
            return None
        rows = [result.sample_rows[i] for i in live]
        logits = result.logits
        argmax = result.argmax
        if len(live) < len(result.sample_rows):  # some ended as the step before was read
            logits = logits.index_select(0, to_device(live, torch.long, logits.device))
            argmax = [argmax[i] for i in live] if argmax is not None else None
        try:
            tokens, logprobs = core.sampler.sample(logits, rows, argmax)
            flight = InFlight(rows, DeferredTokens(tokens), logprobs)
        except Exception:
            log.warning(
                "sampling %d rows failed; sampling them one by one", len(rows), exc_info=True
            )
            picks = sample_isolated(core.sampler, logits, rows)
            # A row that failed fails its request when read; its next input is never used.
            ids = [0 if isinstance(p, Exception) else p[0] for p in picks]
            flight = InFlight(rows, DeferredTokens(ids), [], picks)
        max_len = core.max_model_len
        for i, r in enumerate(rows):
            r.all_token_ids.append(PLACEHOLDER)
            r.pending_row = i
            if r.num_output_tokens >= r.max_tokens or r.num_tokens >= max_len:
                # Its last token: nothing of it runs again, so its seat in the batch and its
                # blocks go to others now (a GPU reuses them after this step, in stream order).
                core.scheduler.retire(r)
        return flight

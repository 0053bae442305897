"""The output processor: each step's new tokens in, each prompt's new text out.

It runs beside the server (or the offline `LLM`), never in the engine core: incremental
detokenizing, stop strings (a match ends the sequence here, and the caller tells the core to
abort it), the fan-in of a prompt's n completions, and the per-token timings the latency
metrics observe. What it hands on is deltas only — the new text, token ids and logprobs of each
completion — so streaming a long answer costs the same per token at its end as at its start.
Under a stream interval of K (`kvfleet serve --stream-interval`) a completion's deltas are held
until they bring K tokens, its first and its last going at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfleet.runtime.engine.core_messages import CoreRequest, SequenceOutput, failure_message
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.token_logprob import TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionDelta:
    """What one completion gained: new text, token ids and logprobs, and its end if it did."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one prompt of a request gained in one step, over its n completions."""

    prompt_index: int
    completions: list[CompletionDelta]
    finished: bool  # every completion of the prompt has ended
    num_cached_tokens: int = 0
    # The prompt's logprobs (when asked for), once, in the prompt's first delta.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # the engine gave up on this prompt alone


class SequenceObserver(Protocol):
    """Hook for latency metrics, called as a sequence's tokens arrive and when it ends."""

    def on_first_token(self, seq: SequenceState, now: float) -> None: ...
    def on_token(self, seq: SequenceState, now: float) -> None: ...
    def on_finished(self, seq: SequenceState, now: float) -> None: ...


@dataclass(slots=True)
class SequenceState:
    """One completion as the output processor follows it (the metrics read its timings)."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_text: int = 0  # characters of the visible text already handed on
    # Under a stream interval: whether its first delta has gone, and what it holds back since.
    delivered: bool = False
    pending: CompletionDelta | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class PromptState:
    """One prompt of a request: its completions, where its deltas go, and what is held back
    until its prompt logprobs (which come before any completion's text) have arrived."""

    group_id: str
    prompt_index: int
    sink: Callable[[RequestDelta], None]
    sequences: list[SequenceState]
    wants_prompt_logprobs: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    held: dict[int, CompletionDelta] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


class OutputProcessor:
    """Follows every live sequence; `process` turns a step's outputs into prompt deltas."""

    def __init__(
        self, tokenizer: Any, observer: SequenceObserver | None = None, stream_interval: int = 1
    ) -> None:
        self._tokenizer = tokenizer.backend_tokenizer  # tokenizers.Tokenizer (the fast one)
        self.observer = observer
        self.stream_interval = stream_interval
        self._prompts: dict[str, PromptState] = {}  # group id → prompt
        self._sequences: dict[str, tuple[PromptState, SequenceState]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def add(
        self,
        prompt_index: int,
        sequences: list[CoreRequest],
        sink: Callable[[RequestDelta], None],
    ) -> None:
        """Follow a prompt's sequences (as the input processor made them); its deltas go to
        `sink`."""
        first = sequences[0]
        params = first.params
        prompt = PromptState(
            first.group_id,
            prompt_index,
            sink,
            [
                SequenceState(
                    r.request_id,
                    r.index,
                    params,
                    IncrementalDetokenizer(
                        self._tokenizer,
                        params.stop,
                        params.skip_special_tokens,
                        params.include_stop_str_in_output,
                    ),
                    r.arrival_time,
                    len(r.prompt_token_ids),
                )
                for r in sequences
            ],
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )
        self._prompts[prompt.group_id] = prompt
        for seq in prompt.sequences:
            self._sequences[seq.request_id] = (prompt, seq)

    def abort(self, group_id: str, now: float) -> list[str]:
        """Stop following a prompt (its client left); return its sequences still running,
        for the core to abort."""
        prompt = self._prompts.get(group_id)
        if prompt is None:
            return []
        running = [s.request_id for s in prompt.sequences if not s.finished]
        for seq in prompt.sequences:
            if not seq.finished:
                self._finish(seq, "abort", None, now)
        self._forget(prompt)
        return running

    def fail(self, group_id: str, message: str, now: float) -> None:
        """End a prompt with an error the core could not report (it refused the sequences)."""
        prompt = self._prompts.get(group_id)
        if prompt is not None:
            self._fail(prompt, message, now)

    def process(self, outputs: list[SequenceOutput], now: float) -> dict[str, list[str]]:
        """Apply one step's outputs and hand each touched prompt its delta; return the
        sequences the core must now abort, by finish reason: "stop" for a stop string found
        here, "error" for a prompt whose output could not be processed (that prompt alone
        fails, as a fault in the core fails only its own request)."""
        touched: dict[str, dict[int, CompletionDelta]] = {}
        aborts: dict[str, list[str]] = {}
        for out in outputs:
            found = self._sequences.get(out.request_id)
            if found is None:
                continue  # aborted here while the step ran
            prompt, seq = found
            if out.error is not None:
                self._fail(prompt, out.error, now)
                touched.pop(prompt.group_id, None)
                continue
            try:
                delta = self._take(prompt, seq, out, now)
            except Exception as exc:
                log.error("request %s failed; the engine goes on", prompt.group_id, exc_info=exc)
                running = [s.request_id for s in prompt.sequences if not s.finished]
                aborts.setdefault("error", []).extend(running)
                self._fail(prompt, failure_message(exc), now)
                touched.pop(prompt.group_id, None)
                continue
            if seq.finish_reason == "stop" and out.finish_reason is None:
                aborts.setdefault("stop", []).append(seq.request_id)
            if delta is not None and self.stream_interval > 1:
                delta = self._paced(seq, delta)
            if delta is not None:
                touched.setdefault(prompt.group_id, {})[seq.index] = delta
        for group_id, deltas in touched.items():
            self._deliver(self._prompts[group_id], deltas)
        return aborts

    def _take(
        self, prompt: PromptState, seq: SequenceState, out: SequenceOutput, now: float
    ) -> CompletionDelta | None:
        if out.first_scheduled_time is not None:
            seq.first_scheduled_time = out.first_scheduled_time
        if out.prompt_logprobs is not None:
            prompt.prompt_logprobs = out.prompt_logprobs
        if seq.index == 0 and out.num_cached_tokens:
            prompt.num_cached_tokens = out.num_cached_tokens
        return self._apply(seq, out, now)

    # --- one sequence ------------------------------------------------------------------------
    def _apply(self, seq: SequenceState, out: SequenceOutput, now: float) -> CompletionDelta | None:
        tokens = out.new_token_ids
        # The core ends a sequence with "stop" only on a stop token (EOS or stop_token_ids):
        # that token counts but is not text, as in vLLM's API.
        last_is_stop_token = out.finish_reason == "stop"
        taken = 0
        if tokens:
            # Once per step, as vLLM observes: a verify step's tokens arrive together, and
            # zero gaps between them would drag the inter-token latency histogram down.
            self._observe_token(seq, now)
        for i, token in enumerate(tokens):
            taken += 1
            seq.num_output_tokens += 1
            if last_is_stop_token and i == len(tokens) - 1:
                break
            may_stop = seq.num_output_tokens >= seq.params.min_tokens
            stop = seq.detokenizer.add(token, check_stop=may_stop)
            if stop is not None:
                self._finish(seq, "stop", stop, now)
                break
        if not seq.finished and out.finish_reason is not None:
            self._finish(seq, out.finish_reason, out.stop_reason, now)
        visible = seq.detokenizer.visible_text(seq.finished)
        text = visible[seq.sent_text :]
        seq.sent_text = len(visible)
        logprobs = out.new_logprobs[:taken] if out.new_logprobs is not None else None
        if not text and not taken and not seq.finished:
            return None
        return CompletionDelta(
            seq.index,
            text,
            tokens[:taken] if taken < len(tokens) else tokens,
            logprobs,
            seq.finish_reason,
            seq.stop_reason,
        )

    def _paced(self, seq: SequenceState, delta: CompletionDelta) -> CompletionDelta | None:
        """`delta` joined to what `seq` holds back, once due: its first delta and its last go
        at once (time to first token, the end), the others when they bring `stream_interval`
        tokens. Fewer, larger deltas: less for the server to write and clients to read."""
        if seq.pending is not None:
            delta = _joined(seq.pending, delta)
            seq.pending = None
        if seq.delivered and not seq.finished and len(delta.token_ids) < self.stream_interval:
            seq.pending = delta
            return None
        seq.delivered = True
        return delta

    def _observe_token(self, seq: SequenceState, now: float) -> None:
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
        if self.observer is not None:
            (self.observer.on_first_token if first else self.observer.on_token)(seq, now)
        seq.last_token_time = now

    def _finish(self, seq: SequenceState, reason: str, stop: str | int | None, now: float) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop
        if self.observer is not None:
            self.observer.on_finished(seq, now)

    # --- one prompt --------------------------------------------------------------------------
    def _deliver(self, prompt: PromptState, deltas: dict[int, CompletionDelta]) -> None:
        if prompt.wants_prompt_logprobs and prompt.prompt_logprobs is None:
            # A sibling sampled before the prompt was scored: its part waits for the logprobs.
            for index, delta in deltas.items():
                held = prompt.held.get(index)
                prompt.held[index] = delta if held is None else _joined(held, delta)
            return
        first = prompt.wants_prompt_logprobs  # and they are here: this delta brings them
        if prompt.held:
            for index, delta in deltas.items():
                held = prompt.held.pop(index, None)
                prompt.held[index] = delta if held is None else _joined(held, delta)
            deltas, prompt.held = prompt.held, {}
        finished = prompt.finished
        if finished:
            self._forget(prompt)
        prompt.sink(
            RequestDelta(
                prompt.prompt_index,
                [deltas[i] for i in sorted(deltas)],
                finished,
                prompt.num_cached_tokens,
                prompt.prompt_logprobs if first else None,
            )
        )
        if first:
            prompt.wants_prompt_logprobs = False  # sent: later deltas carry none

    def _fail(self, prompt: PromptState, message: str, now: float) -> None:
        for seq in prompt.sequences:
            if not seq.finished:
                self._finish(seq, "error", None, now)
        self._forget(prompt)
        prompt.sink(RequestDelta(prompt.prompt_index, [], True, error=message))

    def _forget(self, prompt: PromptState) -> None:
        self._prompts.pop(prompt.group_id, None)
        for seq in prompt.sequences:
            self._sequences.pop(seq.request_id, None)


def _joined(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    """Two consecutive deltas of one completion as one."""
    logprobs = None if a.logprobs is None else [*a.logprobs, *(b.logprobs or [])]
    return CompletionDelta(
        a.index, a.text + b.text, [*a.token_ids, *b.token_ids], logprobs, b.finish_reason,
        b.stop_reason,
    )  # fmt: skip

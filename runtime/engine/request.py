"""A request as the engine sees it, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.token_logprob import TokenLogprob

if TYPE_CHECKING:
    from kvfleet.runtime.engine.grammar_matchers import SequenceGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One sequence being generated. `n > 1` becomes n Requests sharing a `group_id`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    group_id: str = ""
    index: int = 0  # position among the group's n completions
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] | None = None
    # One entry per prompt token computed so far (the first is None: nothing precedes it).
    # Only the group's first sibling collects them: the siblings share the prompt.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Filled by the detokenizer: text of the output so far, and how much of it is safe to show
    # (a possible stop string at the end is held back while it could still match).
    output_text: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    grammar: SequenceGrammar | None = None  # its structured-output constraint, if any
    lora_id: int = 0  # the LoRA adapter it runs (the server's id), 0 for the base model
    # Draft tokens proposed to follow it (speculative decoding): not yet its tokens; the next
    # step computes them beside its last token and keeps those the model agrees with.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling (async_step.py): its last token is a placeholder for the token that
    # row `pending_row` of the step in flight samples (-1: every token is known).
    pending_row: int = -1

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            # Wrapped to 64 bits: a seed near the top of its range plus the index must still be
            # a seed torch accepts.
            self.generator = torch.Generator().manual_seed((self.params.seed + self.index) % 2**64)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprob_position(self) -> int | None:
        """The first position whose logits still owe a prompt logprob (for the token after
        it), or None when nothing is owed."""
        owed = self.prompt_logprobs
        if owed is None or len(owed) == len(self.prompt_token_ids):
            return None
        return len(owed) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Whether its next step computes one token, its last (a decode), rather than prompt
        tokens: the split the scheduler orders a step by and the step-time model prices by."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def num_known_tokens(self) -> int:
        """Its tokens, less a placeholder for one still being sampled (async scheduling)."""
        return len(self.all_token_ids) - (self.pending_row >= 0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions, cumulative so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What `generate` returns and what the engine streams: a request's completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Complete once present (outputs wait for it) and shared by every completion; not a copy,
    # so treat it as read-only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set when the engine gave up on this request alone (its finish_reason is then "error"):
    # what went wrong, for the client. The engine itself goes on serving the others.
    error: str | None = None

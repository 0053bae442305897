"""What the server process and the engine core say to each other: msgspec structs, encoded as
MessagePack on the two ZeroMQ sockets between them (core_client.py, core_process.py).

The core sends, per step, each request's new tokens only (never a whole output again), so a
step's message costs the same whether a request has produced 1 token or 10,000. Structs are
`array_like` (encoded as arrays, no field names on the wire) and `gc=False` where they hold no
cycles: a step's message for 256 requests encodes and decodes in tens of microseconds.
"""

from __future__ import annotations

import msgspec
from kvfleet.runtime.engine.sampling_params import SamplingParams
from kvfleet.runtime.engine.token_logprob import TokenLogprob


def failure_message(exc: BaseException) -> str:
    """What the client of a request the engine gave up on is told (the core's faults and the
    output processor's alike)."""
    return f"the engine could not finish this request: {type(exc).__name__}: {str(exc)[:200]}"


class CoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One sequence for the core to generate: a completion of a prompt. A request with n
    completions is n of these, added in one message so that they share the prompt's blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved by the input processor: params.max_tokens or what fits
    group_id: str
    index: int  # which of the group's n completions (its seed is the request's seed + index)
    arrival_time: float  # time.monotonic() in the server process (one clock per host)
    # Its structured-output constraint, converted by the input processor: a serialized
    # xgrammar Grammar (structured_outputs.grammar_of), compiled by the core.
    grammar: str | None = None
    lora_id: int = 0  # the LoRA adapter it runs (AddLora's id), 0: the base model


class SequenceOutput(msgspec.Struct, array_like=True, gc=False):
    """What one sequence gained in one step: its new tokens (with their logprobs when asked),
    and how it ended if it did. Token-level stops (EOS, stop_token_ids, length) are decided
    in the core; stop strings in the server, which then aborts the sequence here."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it (EOS: None, as vLLM)
    # Sent once, with the sequence's first output: when it was first scheduled, how many of
    # its prompt tokens the prefix cache held, and (first sibling only) the prompt logprobs.
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why the core gave up on this sequence alone


class EngineStats(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A consistent snapshot of the core's gauges and counters, sent after every step so that
    /metrics never reads engine state across processes."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = msgspec.field(default_factory=dict)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Sequences the core has taken in since it started: the server subtracts them from those
    # it sent to know how many are still on the way (queued, as far as admission is concerned).
    received: int = 0
    # Under --enable-lora: the adapters of running and of waiting sequences, by name.
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)
    # Under --speculative-config (speculator.SpecDecodeCounters): proposals verified, draft
    # tokens, accepted tokens, accepted by position (one entry per draft position; empty
    # when speculation is off).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)


class CoreInfo(msgspec.Struct, array_like=True):
    """What the server needs to know of a loaded core: the model's limits and where its
    tokenizer lives (a Hub model is only downloaded by the core)."""

    model_folder: str | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    kv_cache_dtype: str


# --- server → core ---------------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]
    reason: str = "abort"  # "stop" when the server found a stop string


class AddLora(msgspec.Struct, tag=True, array_like=True):
    """Load a LoRA adapter from a local PEFT folder; the core answers in the next
    StepOutputs' `loras` (the server numbers adapters, never reusing an id)."""

    lora_id: int
    name: str
    path: str


class RemoveLora(msgspec.Struct, tag=True, array_like=True):
    lora_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddRequests | AbortRequests | AddLora | RemoveLora | Shutdown


# --- core → server ---------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    info: CoreInfo
    stats: EngineStats


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    message: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[SequenceOutput]
    stats: EngineStats
    now: float  # time.monotonic() when the step's tokens were sampled
    # Requests the core refused when they were added (the server had validated them, so this
    # is a defect, not bad input): (request id, why), each ended with an error.
    refused: list[tuple[str, str]] = msgspec.field(default_factory=list)
    # Answers to AddLora: (lora id, "" when loaded, else why it was refused).
    loras: list[tuple[int, str]] = msgspec.field(default_factory=list)


class CoreDied(msgspec.Struct, tag=True, array_like=True):
    message: str


FromCore = Ready | LoadFailed | StepOutputs | CoreDied

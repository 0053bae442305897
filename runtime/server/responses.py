"""OpenAI response pieces: usage, logprobs objects, and a non-streamed choice gathered from
the engine's deltas."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.runtime.engine.output_processor import CompletionDelta
from kvfleet.runtime.engine.token_logprob import TokenLogprob

# JSON has no -Infinity: a token the sampler could never pick is reported as this (as vLLM does).
LOGPROB_FLOOR = -9999.0

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def completion_logprobs(
    entries: list[TokenLogprob],
    token_text: TokenText,
    text_offset: int,
    prompt: list[tuple[int, TokenLogprob | None]] | None = None,
) -> dict[str, Any]:
    """The legacy completions logprobs object for the given tokens, after the echoed `prompt`'s
    (token id, logprob) pairs when given: its first token has no logprob, so nulls there."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, e in [*(prompt or []), *((e.token_id, e) for e in entries)]:
        t = token_text(token_id)
        tokens.append(t)
        token_logprobs.append(_lp(e.logprob) if e is not None else None)
        top.append({token_text(i): _lp(lp) for i, lp in e.top} if e is not None else None)
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        t = token_text(token_id)
        return {"token": t, "logprob": _lp(logprob), "bytes": list(t.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
            for e in entries
        ]
    }


@dataclass(slots=True)
class ChoiceSoFar:
    """One choice of a non-streamed answer, gathered from its deltas."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def take(self, delta: CompletionDelta) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def now() -> int:
    return int(time.time())

"""A sampled token's log-probability: what the core sends and the server formats. Its own
torch-free module, so that the server process can read the core's messages without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
